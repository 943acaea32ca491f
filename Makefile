# The verbs: `make run` serves the API locally, `make test` lints, checks the deployable bundle and runs
# every test, `make bench` prints the benchmarks. Each creates what it needs on first use: .venv for the
# project, .venv-sam for the SAM CLI (its pins are its own), .cache/bin for actionlint.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
SAM_VERSION := 1.170.0
SAM := .venv-sam/bin/sam
ACTIONLINT_VERSION := v1.7.12
ACTIONLINT := .cache/bin/actionlint
# sam validate needs a region and no account: nothing here calls AWS.
OFFLINE_AWS := SAM_CLI_TELEMETRY=0 AWS_REGION=us-east-1 AWS_DEFAULT_REGION=us-east-1

.PHONY: install run test lint check-bundle kafka-jars format bench openapi clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

$(SAM):
	$(PYTHON) -m venv .venv-sam
	.venv-sam/bin/python -m pip install --quiet aws-sam-cli==$(SAM_VERSION)

$(ACTIONLINT):
	GOBIN=$(CURDIR)/.cache/bin go install github.com/rhysd/actionlint/cmd/actionlint@$(ACTIONLINT_VERSION)

install: $(STAMP)

run: $(STAMP) kafka-jars
	$(BIN)/poimen dev

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/cfn-lint template.yaml

# The deployable bundle, offline: the template as `sam deploy` will see it, the deploy workflow, and
# the layer's requirements as wheels for the Lambda runtime (python3.13, arm64), so `sam build` cannot
# fail on a missing wheel.
check-bundle: $(STAMP) $(SAM) $(ACTIONLINT)
	$(OFFLINE_AWS) $(SAM) validate --lint --template template.yaml
	$(ACTIONLINT) .github/workflows/deploy.yml
	rm -rf .cache/layer-wheels
	$(BIN)/python -m pip download --quiet --only-binary=:all: --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
		--implementation cp --python-version 3.13 -r layers/poimen/requirements.txt -d .cache/layer-wheels

# The local Kafka broker's jars, from Maven Central into .cache/kafka (needs Java 17 and Maven).
kafka-jars: $(STAMP)
	$(BIN)/python -c "from poimen_tools.local.kafka_broker import kafka_jars; print(kafka_jars())"

test: lint check-bundle kafka-jars
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
	rm -rf $(VENV) .venv-sam .cache .mypy_cache .ruff_cache .pytest_cache .coverage
