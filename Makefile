# Two entry points: `make train` (the quickstart run) and `make test` (the suite).
# Both create .venv and install the project into it on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
QUICKSTART_ARGS := --strategy ddp --model resnet18 --width 16 --devices 2 --global-batch-size 128 \
	--epochs 2 --synthetic-size 5000,1000 --lr 0.1 --out runs/quickstart --overwrite

.PHONY: train test install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

train: install
	$(BIN)/jaxdp train $(QUICKSTART_ARGS)

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf runs .pytest_cache
