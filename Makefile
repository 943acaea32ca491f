# The verbs: `make run` serves the API locally, `make test` lints and runs every test, `make bench`
# prints the admission benchmark. Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: install run test lint format bench openapi clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

run: $(STAMP)
	$(BIN)/poimen dev

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/cfn-lint template.yaml

test: lint
	$(BIN)/pytest --cov --cov-report=term

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/python -m benchmarks.admission_bench
	$(BIN)/python -m benchmarks.relay_bench

openapi: $(STAMP)
	$(BIN)/python -m poimen_tools.openapi > infra/openapi.json

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .coverage
