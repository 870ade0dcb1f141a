"""Model parallelism composed with the data-parallel strategies: tensor parallelism on the
``model`` mesh axis (``tensor.py``) and pipeline stages on the ``stage`` axis (``pipeline.py``).

The strategies in ``jaxdp.strategies`` keep working over the ``data`` axis unchanged; these
modules say where a model's variables live on the other axes and which collectives its
layers run there. What is model-specific (which layers split how) lives beside each model
(``jaxdp/models/vit/parallel.py``), as torchtitan keeps its ``parallelize.py`` per model.
"""
