# The verbs: `make run` serves the API locally, `make test` lints, checks the deployable bundle and runs
# every test, `make check` is the inner loop (ruff, mypy, the unit tests), `make bench` prints the benchmarks, `make build` / `make deploy` are what the deploy
# workflow runs. Each creates what it needs on first use: .venv for the project, .venv-sam for the SAM
# CLI (its pins are its own), .cache/bin for actionlint, the RIE and the history checker.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
SAM_VERSION := 1.170.0
SAM := .venv-sam/bin/sam
# checkov, in a venv of its own like the SAM CLI (its pins clash with the project's). Offline: no download
# from Prisma Cloud, no version check. `make lint` scans template.yaml, then the template as CloudFormation
# gets it (Fn::ForEach expanded, SAM transformed, offline) with the hardened parameters below; findings
# and suppressions: docs/posture.md.
CHECKOV_VERSION := 3.3.30
CHECKOV := .venv-checkov/bin/checkov
CHECKOV_SCAN := CKV_SKIP_PACKAGE_UPDATE_CHECK=true $(CHECKOV) --framework cloudformation --skip-download --compact --quiet
CHECKOV_PARAMETERS := Tenants=acme,globex RelayPollerGroups=acme=0,globex=0 SnapStart=PublishedVersions AdmissionReservedConcurrency=100 \
	RelayReservedConcurrency=20 OutboxReservedConcurrency=10 KmsKeyArn=arn:aws:kms:us-east-1:111122223333:key/00000000-0000-0000-0000-000000000000
# Multi-Region mode (docs/operations.md#multi-region), hardened as above: a home stack in us-east-1 with
# replicas in us-east-2 and us-west-2 (a key each), and the us-east-2 replica stack.
CHECKOV_HOME_PARAMETERS := $(CHECKOV_PARAMETERS) TableMode=global-home PeerRegion1=us-east-2 PeerRegion2=us-west-2 \
	PeerRegion1KmsKeyArn=arn:aws:kms:us-east-2:111122223333:key/00000000-0000-0000-0000-000000000000 \
	PeerRegion2KmsKeyArn=arn:aws:kms:us-west-2:111122223333:key/00000000-0000-0000-0000-000000000000 \
	PeerClusterAlias1=east2 PeerClusterAlias2=west2 DispatchSources=Source,Peer1Source,Peer2Source
CHECKOV_REPLICA_PARAMETERS := $(CHECKOV_PARAMETERS) TableMode=global-replica PeerRegion1=us-east-1 PeerRegion2=us-west-2 \
	ReplicaStreamLabel=2026-12-01T10:00:00.000 PeerClusterAlias1=east1 PeerClusterAlias2=west2 \
	DispatchSources=Source,Peer1Source,Peer2Source
# template.yaml as the stack receives it, offline (Fn::ForEach expanded, SAM transformed, every intrinsic
# it cannot resolve kept): infra/poimen_tools/sam_transform.py, run by the SAM CLI's interpreter.
SAM_TRANSFORM := .venv-sam/bin/python infra/poimen_tools/sam_transform.py
ACTIONLINT_VERSION := v1.7.12
ACTIONLINT := .cache/bin/actionlint
# A second DynamoDB engine for the tests (npm, on LevelDB), so nothing relies on one emulator's quirks.
DYNALITE_VERSION := 4.0.0
DYNALITE := .cache/dynalite/node_modules/.bin/dynalite
# The official AsyncAPI parser (npm), which tests/unit/test_asyncapi_parser.py runs on infra/asyncapi.yaml.
ASYNCAPI_PARSER_VERSION := 3.6.6
ASYNCAPI_PARSER := .cache/asyncapi-parser/.installed-$(ASYNCAPI_PARSER_VERSION)
# sam validate and sam build need a region and no account: nothing they do calls AWS.
OFFLINE_AWS := SAM_CLI_TELEMETRY=0 AWS_REGION=$${AWS_REGION:-us-east-1} AWS_DEFAULT_REGION=$${AWS_DEFAULT_REGION:-us-east-1}
# sam build runs the Lambda runtime's interpreter (python3.13, BuildMethod in template.yaml): the one on
# PATH if it runs, else pyenv's newest 3.13.
PYTHON313 := $(shell for p in python3.13 $$(pyenv root 2>/dev/null)/versions/3.13*/bin/python3.13; do \
	"$$p" -c '' 2>/dev/null && { command -v "$$p"; break; }; done)
# Lambda's /opt and task root are read-only: without bytecode every cold start compiles the layer from source
# (3x the INIT time, docs/architecture.md). unchecked-hash: the .pyc stays valid whatever mtimes the zip keeps.
COMPILE_BYTECODE = $(PYTHON313) -m compileall -q -f -j 0 --invalidation-mode unchecked-hash
# The built bundle under the Lambda Runtime Interface Emulator (poimen_tools.local.rie, tests/integration/
# test_rie.py, make bench): the emulator from its Go module, awslambdaric in a python3.13 venv of its own.
RIE_VERSION := v0.0.0-20261030222936-bef5c4ba774d
RIE := .cache/bin/aws-lambda-rie
AWSLAMBDARIC_VERSION := 4.2.2
RIE_RUNTIME := .cache/rie/runtime/.installed-$(AWSLAMBDARIC_VERSION)
# The API's history checker (tests/history/*.go: Porcupine, at the version tests/history/go.sum pins, from the
# Go module proxy), rebuilt when its sources change; tests/history/check.py refuses a stale one.
HISTORY_CHECK := .cache/bin/poimen-history-check
HISTORY_CHECK_SOURCES := $(wildcard tests/history/*.go) tests/history/go.mod tests/history/go.sum
# pytest on PYTEST_WORKERS pytest-xdist workers (-n; `--dist loadgroup` from pyproject.toml: the tests of a
# module with fixtures of its own on one worker, tests/conftest.py). Most integration tests wait on processes
# (`poimen dev`, a broker, the RIE), not on CPU: 4 workers on 2 cores; PYTEST_WORKERS=0 runs in one process.
# Every run prints its 20 slowest tests (setup and teardown included).
PYTEST_WORKERS ?= 4
PYTEST := $(BIN)/pytest -n $(PYTEST_WORKERS) --durations=20
# Deploying: the samconfig.toml environment, and the parameters only the deploying account knows.
# TENANTS also reaches `make build`, so a tenant list SAM CLI cannot expand fails before anything ships, and
# so does one longer than a stack serves (infra/poimen_tools/deploy_check.py, by the SAM CLI's interpreter:
# the deploy needs no other venv).
CONFIG_ENV ?= default
TENANTS ?=
DEPLOY_CHECK := .venv-sam/bin/python infra/poimen_tools/deploy_check.py --prog "make $(or $(firstword $(MAKECMDGOALS)),build)"
MSK_CLUSTER_ARN ?=
# The outbox relay's network: the cluster's IAM bootstrap brokers, and subnets/security groups (comma-separated)
# from which they are reachable.
KAFKA_BOOTSTRAP_SERVERS ?=
OUTBOX_SUBNET_IDS ?=
OUTBOX_SECURITY_GROUP_IDS ?=
ALARM_EMAIL ?=
# Cells (docs/operations.md#cells): CELL=<name> deploys the stack <CONFIG_ENV's stack_name>-<name>, serving
# TENANTS beside the other cells on the same MSK cluster; `make deploy` refuses a tenant another cell serves.
CELL ?=
# Multi-Region mode (docs/operations.md#multi-region): TABLE_MODE=global-home with PEER_REGION_1 and
# PEER_REGION_2 (WITNESS_REGION: one of them, or empty for three replicas), then TABLE_MODE=global-replica in
# each replica Region with the same three and REPLICA_STREAM_LABEL. PEER_CLUSTER_ALIAS_1/_2: the peer Kafka
# clusters whose dispatch topics are replicated here (any mode); PEER_REGION_1_KMS_KEY_ARN/_2_: the replicas'
# keys, home stack with a KmsKeyArn. Empty: not passed (the template's defaults: single Region, no alias; on a
# deployed stack, sam deploy keeps the deployed value). PEER_CLUSTER_ALIAS_1= (given empty on the command line)
# clears the deployed alias, and with it its mappings; so does PEER_CLUSTER_ALIAS_2=. The deploy passes the
# template's DispatchSources for the aliases the stack will have (deploy_check.py cells derives it).
TABLE_MODE ?=
PEER_REGION_1 ?=
PEER_REGION_2 ?=
WITNESS_REGION ?=
REPLICA_STREAM_LABEL ?=
PEER_CLUSTER_ALIAS_1 ?=
PEER_CLUSTER_ALIAS_2 ?=
PEER_REGION_1_KMS_KEY_ARN ?=
PEER_REGION_2_KMS_KEY_ARN ?=
# The DispatchSources parameter the cell check derives from the aliases the stack will have, for sam deploy.
DISPATCH_SOURCES := .aws-sam/dispatch-sources.parameter
# Poller groups (docs/operations.md#poller-groups): the RelayPollerGroups parameter the group check computes from
# the mappings already in each of the cluster's groups (deploy_check.py groups), or checks when
# RELAY_POLLER_GROUPS=tenant=group,... is given; RELAY_POLLER_GROUPS=ungrouped opts out (an EPU a mapping).
RELAY_POLLER_GROUPS ?=
POLLER_GROUPS := .aws-sam/poller-groups.parameter
# RelayMaximumPollers as the deploy passes it (samconfig.toml's overrides; empty: the deployed stack's, or 3).
RELAY_MAXIMUM_POLLERS = $(patsubst RelayMaximumPollers=%,%,$(filter RelayMaximumPollers=%,$(STAGE_PARAMETERS)))
# RelayEventPollers likewise (empty: the deployed stack's, or provisioned): on-demand mappings join no poller group.
RELAY_EVENT_POLLERS = $(patsubst RelayEventPollers=%,%,$(filter RelayEventPollers=%,$(STAGE_PARAMETERS)))
# The numbers of the aliases given empty on the command line: cleared, passed as '' (SAM CLI refuses an override
# with nothing after its '=').
CLEARED_PEER_CLUSTER_ALIASES = $(foreach n,1 2,$(if $(and $(filter command line,$(origin PEER_CLUSTER_ALIAS_$(n))),$(if \
	$(PEER_CLUSTER_ALIAS_$(n)),,cleared)),$(n)))
MULTI_REGION_PARAMETERS = $(if $(TABLE_MODE),"TableMode=$(TABLE_MODE)") $(if $(PEER_REGION_1),"PeerRegion1=$(PEER_REGION_1)") \
	$(if $(PEER_REGION_2),"PeerRegion2=$(PEER_REGION_2)") $(if $(WITNESS_REGION),"WitnessRegion=$(WITNESS_REGION)") \
	$(if $(REPLICA_STREAM_LABEL),"ReplicaStreamLabel=$(REPLICA_STREAM_LABEL)") \
	$(if $(PEER_CLUSTER_ALIAS_1),"PeerClusterAlias1=$(PEER_CLUSTER_ALIAS_1)",$(if $(filter 1,$(CLEARED_PEER_CLUSTER_ALIASES)),"PeerClusterAlias1=''")) \
	$(if $(PEER_CLUSTER_ALIAS_2),"PeerClusterAlias2=$(PEER_CLUSTER_ALIAS_2)",$(if $(filter 2,$(CLEARED_PEER_CLUSTER_ALIASES)),"PeerClusterAlias2=''")) \
	$(if $(PEER_REGION_1_KMS_KEY_ARN),"PeerRegion1KmsKeyArn=$(PEER_REGION_1_KMS_KEY_ARN)") \
	$(if $(PEER_REGION_2_KMS_KEY_ARN),"PeerRegion2KmsKeyArn=$(PEER_REGION_2_KMS_KEY_ARN)")
# RunRetentionDays (docs/architecture.md#run-retention): RUN_RETENTION_DAYS=<days> sets it (empty: runs kept
# forever); unset, samconfig.toml's parameter_overrides or else the deployed value stand. Before deploying, the
# deploy reads the deployed stack's value and passes, with the one it deploys, the record of a change
# (PreviousRunRetentionDays, RunRetentionChangedAt: poimen_tools.retention_change), so that no record from
# before a raise is held to more than the retention its run was written under. A lowering (or turning it on) is
# preceded by its hold (retention_change --hold; nothing to deploy when none is needed), an update that holds
# every record to the lowered retention while admission still writes runs under the deployed one, so that a
# rollback of the change returns to it. A change is deployed pending (every record held to the shorter), and
# once `sam deploy` has completed, a parameter-only deploy records when it took effect (retention_change
# --settle; nothing to deploy when no change is pending, or when the update was rolled back).
RETENTION_CHANGE = $(BIN)/python -m poimen_tools.retention_change --config-env $(CONFIG_ENV) --stack-name "$(STACK_NAME)"
RUN_RETENTION_OPTION = $(if $(filter undefined,$(origin RUN_RETENTION_DAYS)),,--run-retention-days "$(RUN_RETENTION_DAYS)")
# --parameter-overrides on the command line replaces samconfig.toml's, so the deploy repeats the
# environment's own overrides, read from that file (one source for them).
STAGE_PARAMETERS = $(shell $(PYTHON) -c "import tomllib; \
	print(tomllib.load(open('samconfig.toml', 'rb'))['$(CONFIG_ENV)']['deploy']['parameters']['parameter_overrides'])")
STAGE = $(patsubst Stage=%,%,$(filter Stage=%,$(STAGE_PARAMETERS)))
# The deploy, but for the run retention's three parameters (HOLD_PARAMETERS, RETENTION_PARAMETERS, SETTLED_PARAMETERS).
SAM_DEPLOY = SAM_CLI_TELEMETRY=0 $(SAM) deploy --config-env $(CONFIG_ENV) --stack-name $(STACK_NAME) \
	--parameter-overrides $(STAGE_PARAMETERS) "MskClusterArn=$(MSK_CLUSTER_ARN)" "Tenants=$(TENANTS)" \
	"KafkaBootstrapServers=$(KAFKA_BOOTSTRAP_SERVERS)" "OutboxSubnetIds=$(OUTBOX_SUBNET_IDS)" \
	"OutboxSecurityGroupIds=$(OUTBOX_SECURITY_GROUP_IDS)" $(if $(ALARM_EMAIL),"AlarmEmail=$(ALARM_EMAIL)") \
	$(if $(CELL),"Cell=$(CELL)") $(MULTI_REGION_PARAMETERS)
STACK_NAME = $(shell $(PYTHON) -c "import tomllib; \
	print(tomllib.load(open('samconfig.toml', 'rb'))['$(CONFIG_ENV)']['global']['parameters']['stack_name'])")$(if $(CELL),-$(CELL))

.PHONY: install run test check lint check-bundle build deploy kafka-jars dynalite asyncapi-parser rie rie-bundle history-check format \
	bench soak \
	openapi docs clean

$(STAMP): pyproject.toml
	@echo "make: creating $(VENV) and installing the project into it with $(PYTHON) (pip, about a minute)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

$(CHECKOV):
	@echo "make: installing checkov $(CHECKOV_VERSION) into .venv-checkov (pip, about a minute)"
	$(PYTHON) -m venv .venv-checkov
	.venv-checkov/bin/python -m pip install --quiet checkov==$(CHECKOV_VERSION)

$(SAM):
	@echo "make: installing the SAM CLI $(SAM_VERSION) into .venv-sam (pip, about a minute)"
	$(PYTHON) -m venv .venv-sam
	.venv-sam/bin/python -m pip install --quiet aws-sam-cli==$(SAM_VERSION)

$(DYNALITE):
	@echo "make: installing dynalite $(DYNALITE_VERSION) into .cache/dynalite (npm, about 20 s)"
	npm install --prefix .cache/dynalite --no-audit --no-fund --silent dynalite@$(DYNALITE_VERSION)

dynalite: $(DYNALITE)

$(ASYNCAPI_PARSER):
	@echo "make: installing @asyncapi/parser $(ASYNCAPI_PARSER_VERSION) into .cache/asyncapi-parser (npm, about 30 s)"
	rm -rf .cache/asyncapi-parser
	npm install --prefix .cache/asyncapi-parser --no-audit --no-fund --silent @asyncapi/parser@$(ASYNCAPI_PARSER_VERSION)
	touch $@

asyncapi-parser: $(ASYNCAPI_PARSER)

$(ACTIONLINT):
	@echo "make: building actionlint $(ACTIONLINT_VERSION) into .cache/bin (go install, about a minute)"
	GOBIN=$(CURDIR)/.cache/bin go install github.com/rhysd/actionlint/cmd/actionlint@$(ACTIONLINT_VERSION)

$(RIE):
	@echo "make: building the Lambda Runtime Interface Emulator into .cache/bin (go install, about 30 s)"
	GOBIN=$(CURDIR)/.cache/bin go install github.com/aws/aws-lambda-runtime-interface-emulator/cmd/aws-lambda-rie@$(RIE_VERSION)

$(RIE_RUNTIME):
	@test -n "$(PYTHON313)" || { echo "make rie: python3.13 not found (the Lambda runtime's interpreter)" >&2; exit 1; }
	@echo "make: installing awslambdaric $(AWSLAMBDARIC_VERSION) into .cache/rie/runtime (pip, about 20 s)"
	rm -rf .cache/rie/runtime
	$(PYTHON313) -m venv .cache/rie/runtime
	.cache/rie/runtime/bin/python -m pip install --quiet awslambdaric==$(AWSLAMBDARIC_VERSION)
	.cache/rie/runtime/bin/python -m pip uninstall --quiet --yes pip
	touch $@

rie: $(RIE) $(RIE_RUNTIME)

$(HISTORY_CHECK): $(HISTORY_CHECK_SOURCES)
	@echo "make: building the history checker into .cache/bin (go build, about 20 s the first time)"
	cd tests/history && go build -trimpath -o $(CURDIR)/$(HISTORY_CHECK) .

history-check: $(HISTORY_CHECK)

# The x86_64 variant of the bundle in .cache/rie-build, built and compiled as `make build` does (the RIE
# tests build it once per session themselves; this is for running a function by hand, docs/local.md).
rie-bundle: $(STAMP) $(SAM) rie
	$(BIN)/python -m poimen_tools.local.rie build

install: $(STAMP)

run: $(STAMP) kafka-jars
	$(BIN)/poimen dev

lint: $(STAMP) $(SAM) $(CHECKOV)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/cfn-lint template.yaml
	$(CHECKOV_SCAN) --file template.yaml
	@mkdir -p .cache/checkov
	$(OFFLINE_AWS) $(SAM_TRANSFORM) template.yaml $(CHECKOV_PARAMETERS) > .cache/checkov/template.transformed.json
	$(CHECKOV_SCAN) --file .cache/checkov/template.transformed.json
	SAM_CLI_TELEMETRY=0 AWS_DEFAULT_REGION=us-east-1 $(SAM_TRANSFORM) template.yaml $(CHECKOV_HOME_PARAMETERS) \
		> .cache/checkov/template.home.transformed.json
	$(CHECKOV_SCAN) --file .cache/checkov/template.home.transformed.json
	SAM_CLI_TELEMETRY=0 AWS_DEFAULT_REGION=us-east-2 $(SAM_TRANSFORM) template.yaml $(CHECKOV_REPLICA_PARAMETERS) \
		> .cache/checkov/template.replica.transformed.json
	$(CHECKOV_SCAN) --file .cache/checkov/template.replica.transformed.json

# The deployable bundle, offline: the template as `sam deploy` will see it, the deploy workflow, and
# `sam build` for two tenants (tests/integration/test_bundle.py inspects what it built).
check-bundle: $(STAMP) $(SAM) $(ACTIONLINT)
	$(OFFLINE_AWS) $(SAM) validate --lint --template template.yaml
	$(ACTIONLINT) .github/workflows/deploy.yml
	$(MAKE) build TENANTS=acme,globex

# The bundle as the deploy workflow builds it: .aws-sam/build, layer wheels for python3.13 on arm64.
build: $(SAM)
	@test -z "$(TENANTS)" || $(DEPLOY_CHECK) limits --tenants "$(TENANTS)" \
		--peer-aliases $(words $(PEER_CLUSTER_ALIAS_1) $(PEER_CLUSTER_ALIAS_2))
	@test -n "$(PYTHON313)" || { echo "make build: python3.13 not found; sam build needs the Lambda runtime's" \
		"interpreter: install it (pyenv install 3.13) or put it on PATH" >&2; exit 1; }
	$(OFFLINE_AWS) PATH="$(dir $(PYTHON313)):$$PATH" $(SAM) build --config-env $(CONFIG_ENV) \
		$(if $(TENANTS),--parameter-overrides "Tenants=$(TENANTS)")
	$(COMPILE_BYTECODE) .aws-sam/build/*/

# Package and deploy what `make build` built to the stack of CONFIG_ENV (and CELL), with the caller's AWS
# credentials, once CloudFormation says no other cell on the cluster or of the Stage (here, and in the peer
# Regions in multi-Region mode) serves one of TENANTS, with the mappings in poller groups that have room for them
# (or the groups given checked), and with a change of RunRetentionDays recorded.
deploy: build $(STAMP)
	@test -n "$(TENANTS)" -a -n "$(MSK_CLUSTER_ARN)" -a -n "$(KAFKA_BOOTSTRAP_SERVERS)" -a -n "$(OUTBOX_SUBNET_IDS)" \
		-a -n "$(OUTBOX_SECURITY_GROUP_IDS)" || { echo "make deploy: set TENANTS=<ids>, MSK_CLUSTER_ARN=<arn>," \
		"KAFKA_BOOTSTRAP_SERVERS=<brokers>, OUTBOX_SUBNET_IDS=<ids> and OUTBOX_SECURITY_GROUP_IDS=<ids> (README, Deploy)" >&2; exit 1; }
	@case "$(TABLE_MODE)" in \
		""|single) test -z "$(PEER_REGION_1)$(PEER_REGION_2)$(WITNESS_REGION)$(REPLICA_STREAM_LABEL)" || { echo "make deploy:" \
			"PEER_REGION_1, PEER_REGION_2, WITNESS_REGION and REPLICA_STREAM_LABEL need TABLE_MODE=global-home or global-replica" >&2; exit 1; } ;; \
		global-home) test -n "$(PEER_REGION_1)" -a -n "$(PEER_REGION_2)" -a -z "$(REPLICA_STREAM_LABEL)" || { echo "make deploy:" \
			"TABLE_MODE=global-home needs PEER_REGION_1 and PEER_REGION_2 and no REPLICA_STREAM_LABEL (docs/operations.md, Multi-Region)" >&2; exit 1; } ;; \
		global-replica) test -n "$(PEER_REGION_1)" -a -n "$(PEER_REGION_2)" -a -n "$(REPLICA_STREAM_LABEL)" || { echo "make deploy:" \
			"TABLE_MODE=global-replica needs PEER_REGION_1, PEER_REGION_2 and REPLICA_STREAM_LABEL (docs/operations.md, Multi-Region)" >&2; exit 1; } ;; \
		*) echo "make deploy: TABLE_MODE is single, global-home or global-replica, not '$(TABLE_MODE)'" >&2; exit 1 ;; \
	esac
	@mkdir -p $(dir $(DISPATCH_SOURCES))
	$(DEPLOY_CHECK) cells --stack-name "$(STACK_NAME)" --cell "$(CELL)" --tenants "$(TENANTS)" \
		--msk-cluster-arn "$(MSK_CLUSTER_ARN)" --stage "$(STAGE)" --peer-regions "$(PEER_REGION_1),$(PEER_REGION_2)" \
		--peer-cluster-aliases "$(PEER_CLUSTER_ALIAS_1),$(PEER_CLUSTER_ALIAS_2)" \
		--cleared-peer-cluster-aliases "$(strip $(CLEARED_PEER_CLUSTER_ALIASES))" > $(DISPATCH_SOURCES)
	$(DEPLOY_CHECK) groups --stack-name "$(STACK_NAME)" --tenants "$(TENANTS)" --msk-cluster-arn "$(MSK_CLUSTER_ARN)" \
		--dispatch-sources "$$(cat $(DISPATCH_SOURCES))" --maximum-pollers "$(RELAY_MAXIMUM_POLLERS)" \
		--event-pollers "$(RELAY_EVENT_POLLERS)" --poller-groups "$(RELAY_POLLER_GROUPS)" > $(POLLER_GROUPS)
	HOLD_PARAMETERS="$$($(RETENTION_CHANGE) --hold $(RUN_RETENTION_OPTION))" && { test -z "$$HOLD_PARAMETERS" || \
		$(SAM_DEPLOY) "$$(cat $(DISPATCH_SOURCES))" "$$(cat $(POLLER_GROUPS))" $$HOLD_PARAMETERS; } && \
	RETENTION_PARAMETERS="$$($(RETENTION_CHANGE) $(RUN_RETENTION_OPTION))" && \
	$(SAM_DEPLOY) "$$(cat $(DISPATCH_SOURCES))" "$$(cat $(POLLER_GROUPS))" $$RETENTION_PARAMETERS && \
	SETTLED_PARAMETERS="$$($(RETENTION_CHANGE) --settle)" && { test -z "$$SETTLED_PARAMETERS" || \
		$(SAM_DEPLOY) "$$(cat $(DISPATCH_SOURCES))" "$$(cat $(POLLER_GROUPS))" $$SETTLED_PARAMETERS; }

# The local Kafka broker's jars, from Maven Central into .cache/kafka (needs Java 17 and Maven).
kafka-jars: $(STAMP)
	@ls .cache/kafka/*/lib/.complete >/dev/null 2>&1 || \
		echo "make: fetching the Kafka broker's jars into .cache/kafka (Maven Central, about a minute)"
	$(BIN)/python -c "from poimen_tools.local.kafka_broker import kafka_jars; print(kafka_jars())"

# What pytest needs, made side by side (installs wait on the network, lint and the bundle on CPU; each target's
# output printed whole once it ends), then the tests.
TEST_PREREQUISITES := lint check-bundle kafka-jars dynalite asyncapi-parser rie history-check

test:
	$(MAKE) --jobs=4 --output-sync=target $(TEST_PREREQUISITES)
	$(PYTEST) --cov --cov-report=term

# The inner loop: lint and types of the Python tree and the unit tests (no broker, no bundle), within 3 minutes on
# two idle cores: the unit tests' CPU, user + sys of `$(PYTEST) tests/unit`, must stay near 300 s (306 s measured
# at load 4-10, from 379 s; docs/architecture.md#tests-what-make-test-checks). The
# SAM CLI's venv: the template tests transform template.yaml as CloudFormation gets it (tests/unit/transforms.py).
check: $(STAMP) $(SAM) asyncapi-parser history-check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(PYTEST) tests/unit

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP) $(SAM) rie kafka-jars dynalite
	$(BIN)/python -m benchmarks.cold_start
	$(BIN)/python -m benchmarks.admission_bench
	$(BIN)/python -m benchmarks.relay_bench
	$(BIN)/python -m benchmarks.outbox_bench

# 10,000 dispatch messages through a real broker and `poimen dev`, killed twice and the broker restarted
# once, over 2 tenants and then over 100; exits non-zero unless every key is one run and nothing was
# dead-lettered (several minutes each), and prints both soaks' throughput and relay lag side by side. Then the
# long API history: 20,000 operations under DynamoDB faults and kills, checked by Porcupine (about 30 minutes).
soak: $(STAMP) kafka-jars $(HISTORY_CHECK)
	$(BIN)/python -m benchmarks.soak --tenants 2,100
	$(BIN)/python -m benchmarks.history

openapi: $(STAMP)
	$(BIN)/python -m poimen_tools.openapi > infra/openapi.json

# docs/cli.md, the CLI reference, from the argparse parser (tests/unit/test_docs.py fails when it is stale).
docs: $(STAMP)
	$(BIN)/python -m poimen_tools.clidoc > docs/cli.md.tmp
	mv docs/cli.md.tmp docs/cli.md

clean:
	rm -rf $(VENV) .venv-sam .venv-checkov .cache .aws-sam .mypy_cache .ruff_cache .pytest_cache .coverage
