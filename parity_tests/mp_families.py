"""The model families the model-parallel parity harness knows (``TPConfig.family``), one row each.

A row says, for a config: the family's sizes (the torch twin's ``cfg["model"]``), one example's
shape and the class count (the batches), the torch model (whose init both sides start from),
jaxdp's float64 model with its FSDP units (zero3), and jaxdp's variables from the torch
``state_dict``. ``family`` looks a name up once, for ``TPConfig.family_row``; nothing branches on one.

    vit     a small ViT (``TPConfig.vit``), split Megatron's way or cut into pipeline stages
    resnet  a small ResNet (``TPConfig.resnet``) on 16x16 images, channel-parallel
    toy     the DDP tutorial's ToyMpModel (10 features, 5 classes), cut into two stages

Nothing imports jax or torch at module level (``--devices`` must reach XLA first).
"""

from typing import Dict, Tuple

from parity_tests.config import ParityError

RESNET_IMAGE_SIZE = 16  # 8x8 leaves layer4 1x1: its BatchNorm over 4 values amplifies rounding 100x in 10 steps


class MPFamily:
    """A classifier with ``num_classes`` in its sizes, converted by ``jaxdp.interop``'s layouts,
    whose FSDP units are its module's (``jaxdp.models.fsdp_units``): what the ViT and ResNet share."""

    def sizes(self, cfg) -> dict:
        raise NotImplementedError

    def input_shape(self, cfg) -> Tuple[int, ...]:
        raise NotImplementedError

    def classes(self, cfg) -> int:
        return self.sizes(cfg)["num_classes"]

    def torch_model(self, cfg):
        raise NotImplementedError

    def flax_model(self, cfg):
        raise NotImplementedError

    def jax_model(self, cfg):
        """jaxdp's twin in float64, and its FSDP units (zero3)."""
        from jaxdp.models import fsdp_units

        model = self.flax_model(cfg)
        return model, fsdp_units(model)

    def variables(self, cfg, model, state_dict) -> dict:
        """jaxdp's float64 variables from a torch ``state_dict``."""
        from jaxdp.interop import variables_from_state_dict

        return variables_from_state_dict(state_dict, dtype="float64")


class ViTFamily(MPFamily):
    def sizes(self, cfg) -> dict:
        return dict(cfg.vit)

    def input_shape(self, cfg) -> Tuple[int, ...]:
        return (cfg.vit["image_size"], cfg.vit["image_size"], 3)

    def torch_model(self, cfg):
        from torch_ref.vit import VisionTransformer

        return VisionTransformer(**cfg.vit)

    def flax_model(self, cfg):
        import jax.numpy as jnp

        from jaxdp.models.vit import ViT

        return ViT(**cfg.vit, dtype=jnp.float64, param_dtype=jnp.float64)


class ResNetFamily(MPFamily):
    def sizes(self, cfg) -> dict:
        return dict(cfg.resnet)

    def input_shape(self, cfg) -> Tuple[int, ...]:
        return (RESNET_IMAGE_SIZE, RESNET_IMAGE_SIZE, 3)

    def torch_model(self, cfg):
        from torch_ref.models import resnet

        return resnet(**cfg.resnet)

    def flax_model(self, cfg):
        from jaxdp.models import create_model

        return create_model(dtype="float64", **cfg.resnet)


class ToyFamily(MPFamily):
    """The DDP tutorial's model (``parity_tests.pipeline_parallel``): no sizes to choose, one
    stage per linear layer, so no zero3 units; its params are named as torch's."""

    def sizes(self, cfg) -> dict:
        return {}

    def input_shape(self, cfg) -> Tuple[int, ...]:
        from torch_ref.pipeline import IN_FEATURES

        return (IN_FEATURES,)

    def classes(self, cfg) -> int:
        from torch_ref.pipeline import OUT_FEATURES

        return OUT_FEATURES

    def torch_model(self, cfg):
        from torch_ref.pipeline import ToyMpModel

        return ToyMpModel()

    def jax_model(self, cfg):
        import jax.numpy as jnp

        from jaxdp.models.toy import ToyMpModel

        return ToyMpModel(dtype=jnp.float64, param_dtype=jnp.float64), ()

    def variables(self, cfg, model, state_dict) -> dict:
        """Through its params' names (the layouts know no toy)."""
        import jax
        import jax.numpy as jnp

        from jaxdp.interop import tree_from_torch_names

        like = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *self.input_shape(cfg)), jnp.float64))
        return {"params": tree_from_torch_names(state_dict, like["params"])}


FAMILIES: Dict[str, MPFamily] = {"vit": ViTFamily(), "resnet": ResNetFamily(), "toy": ToyFamily()}


def family(name: str) -> MPFamily:
    """The row of a family name (ParityError, one line, for another)."""
    if name not in FAMILIES:
        raise ParityError(f"the model-parallel parity runs the families {', '.join(FAMILIES)}, not {name!r}")
    return FAMILIES[name]

