# The verbs: `make run` serves the API locally, `make test` lints, checks the deployable bundle and runs
# every test, `make bench` prints the benchmarks, `make build` / `make deploy` are what the deploy
# workflow runs. Each creates what it needs on first use: .venv for the project, .venv-sam for the SAM
# CLI (its pins are its own), .cache/bin for actionlint.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
SAM_VERSION := 1.170.0
SAM := .venv-sam/bin/sam
ACTIONLINT_VERSION := v1.7.12
ACTIONLINT := .cache/bin/actionlint
# A second DynamoDB engine for the tests (npm, on LevelDB), so nothing relies on one emulator's quirks.
DYNALITE_VERSION := 4.0.0
DYNALITE := .cache/dynalite/node_modules/.bin/dynalite
# sam validate and sam build need a region and no account: nothing they do calls AWS.
OFFLINE_AWS := SAM_CLI_TELEMETRY=0 AWS_REGION=$${AWS_REGION:-us-east-1} AWS_DEFAULT_REGION=$${AWS_DEFAULT_REGION:-us-east-1}
# sam build runs the Lambda runtime's interpreter (python3.13, BuildMethod in template.yaml): the one on
# PATH if it runs, else pyenv's newest 3.13.
PYTHON313 := $(shell for p in python3.13 $$(pyenv root 2>/dev/null)/versions/3.13*/bin/python3.13; do \
	"$$p" -c '' 2>/dev/null && { command -v "$$p"; break; }; done)
# Deploying: the samconfig.toml environment, and the parameters only the deploying account knows.
# TENANTS also reaches `make build`, so a tenant list SAM CLI cannot expand fails before anything ships.
CONFIG_ENV ?= default
TENANTS ?=
MSK_CLUSTER_ARN ?=
ALARM_EMAIL ?=
# --parameter-overrides on the command line replaces samconfig.toml's, so the deploy repeats the
# environment's own overrides, read from that file (one source for them).
STAGE_PARAMETERS = $(shell $(PYTHON) -c "import tomllib; \
	print(tomllib.load(open('samconfig.toml', 'rb'))['$(CONFIG_ENV)']['deploy']['parameters']['parameter_overrides'])")

.PHONY: install run test lint check-bundle build deploy kafka-jars dynalite format bench soak openapi clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

$(SAM):
	$(PYTHON) -m venv .venv-sam
	.venv-sam/bin/python -m pip install --quiet aws-sam-cli==$(SAM_VERSION)

$(DYNALITE):
	npm install --prefix .cache/dynalite --no-audit --no-fund --silent dynalite@$(DYNALITE_VERSION)

dynalite: $(DYNALITE)

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
# `sam build` for two tenants (tests/integration/test_bundle.py inspects what it built).
check-bundle: $(STAMP) $(SAM) $(ACTIONLINT)
	$(OFFLINE_AWS) $(SAM) validate --lint --template template.yaml
	$(ACTIONLINT) .github/workflows/deploy.yml
	$(MAKE) build TENANTS=acme,globex

# The bundle as the deploy workflow builds it: .aws-sam/build, layer wheels for python3.13 on arm64.
build: $(SAM)
	@test -n "$(PYTHON313)" || { echo "make build: python3.13 not found; sam build needs the Lambda runtime's" \
		"interpreter: install it (pyenv install 3.13) or put it on PATH" >&2; exit 1; }
	$(OFFLINE_AWS) PATH="$(dir $(PYTHON313)):$$PATH" $(SAM) build --config-env $(CONFIG_ENV) \
		$(if $(TENANTS),--parameter-overrides "Tenants=$(TENANTS)")

# Package and deploy what `make build` built to the stack of CONFIG_ENV, with the caller's AWS credentials.
deploy: build
	@test -n "$(TENANTS)" -a -n "$(MSK_CLUSTER_ARN)" || { echo "make deploy: set TENANTS=<ids> and" \
		"MSK_CLUSTER_ARN=<arn> (README, Deploy)" >&2; exit 1; }
	SAM_CLI_TELEMETRY=0 $(SAM) deploy --config-env $(CONFIG_ENV) --parameter-overrides $(STAGE_PARAMETERS) \
		"MskClusterArn=$(MSK_CLUSTER_ARN)" "Tenants=$(TENANTS)" $(if $(ALARM_EMAIL),"AlarmEmail=$(ALARM_EMAIL)")

# The local Kafka broker's jars, from Maven Central into .cache/kafka (needs Java 17 and Maven).
kafka-jars: $(STAMP)
	$(BIN)/python -c "from poimen_tools.local.kafka_broker import kafka_jars; print(kafka_jars())"

test: lint check-bundle kafka-jars dynalite
	$(BIN)/pytest --cov --cov-report=term

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/python -m benchmarks.admission_bench
	$(BIN)/python -m benchmarks.relay_bench

# 10,000 dispatch messages through a real broker and `poimen dev`, killed twice and the broker restarted
# once; exits non-zero unless every key is one run and nothing was dead-lettered (several minutes).
soak: $(STAMP) kafka-jars
	$(BIN)/python -m benchmarks.soak

openapi: $(STAMP)
	$(BIN)/python -m poimen_tools.openapi > infra/openapi.json

clean:
	rm -rf $(VENV) .venv-sam .cache .aws-sam .mypy_cache .ruff_cache .pytest_cache .coverage
