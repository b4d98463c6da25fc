# Build targets for `sam build` (template.yaml: Metadata BuildMethod: makefile).
# SAM copies the repository to a scratch directory, runs `make build-<LogicalId>`
# there and sets ARTIFACTS_DIR to the directory it packages for that resource.
#
# Functions: the package holds ONLY handler.py, its bytecode, sql/ and the web view's
# files in web/ (no caches, no dotfiles), so its content hash, which is the S3 key `sam
# deploy` uploads it under and so MigrationFunction's auto-published version, changes
# exactly when handler.py, sql/ or web/ change. Everything else (dependencies, the RDS CA bundle) is in the layer.
#
# Layer: requirements.lock (requirements.txt with every transitive dependency pinned
# and hashed, `make lock`), installed as manylinux wheels for the Lambda runtime with
# --require-hashes, plus the RDS CA bundle at /opt/certs/rds-global-bundle.pem.
#
# Bytecode: the layer and the function ship .pyc files compiled by the runtime's Python
# (LAMBDA_PYTHON, 3.12), hash-based and unchecked, because /opt and /var/task are
# read-only on Lambda (nothing compiled at a cold start is kept) and SAM's zip resets
# file times (timestamp-based .pyc would be stale). Nothing machine-specific goes in:
# no python/bin scripts (they name this machine's interpreter), so the same sources give
# the same layer on any machine with the same Python 3.12 release.

ARTIFACTS_DIR ?= $(error ARTIFACTS_DIR is not set; sam build sets it, or pass ARTIFACTS_DIR=<dir>)

PIP ?= python3 -m pip
LAMBDA_PYTHON_VERSION ?= 3.12
# The interpreter that compiles the bytecode: it must be Python $(LAMBDA_PYTHON_VERSION).
LAMBDA_PYTHON ?= python$(LAMBDA_PYTHON_VERSION)
# Set to 1 to ship no bytecode when no Python $(LAMBDA_PYTHON_VERSION) is at hand (every cold
# start then compiles the libraries: about a second more on a 512 MB function).
ALLOW_NO_BYTECODE ?= 0
LAYER_LOCK ?= requirements.lock
# Lambda python3.12 runs on Amazon Linux 2023 (glibc 2.34), x86_64.
PIP_PLATFORMS ?= manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64
# Where the operator put AWS's RDS global CA bundle (global-bundle.pem).
RDS_CA_BUNDLE ?= certs/rds-global-bundle.pem
# Set to 1 to build the layer without the CA bundle (sam local with DATABASE_URL only).
ALLOW_MISSING_RDS_CA ?= 0

.PHONY: build-ApiFunction build-MigrationFunction build-ReportFunction build-DependenciesLayer function-package lock

# compile_bytecode(directory, directory on Lambda): hash-based unchecked .pyc, one process,
# files in sorted order (so the output is the same on every run).
define compile_bytecode
	@if $(LAMBDA_PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != tuple(int(p) for p in "$(LAMBDA_PYTHON_VERSION)".split(".")))' >/dev/null 2>&1; then \
		$(LAMBDA_PYTHON) -m compileall -q --invalidation-mode unchecked-hash -d "$(2)" "$(1)" >/dev/null; \
	elif [ "$(ALLOW_NO_BYTECODE)" = "1" ]; then \
		echo "WARNING: no Python $(LAMBDA_PYTHON_VERSION) ($(LAMBDA_PYTHON)); $(1) ships without bytecode (slower cold starts)." >&2; \
	else \
		echo "ERROR: the bytecode must be compiled by Python $(LAMBDA_PYTHON_VERSION), the Lambda runtime's, and $(LAMBDA_PYTHON) is not that. Install it, or set LAMBDA_PYTHON=/path/to/python$(LAMBDA_PYTHON_VERSION), or ALLOW_NO_BYTECODE=1." >&2; \
		exit 1; \
	fi
endef

build-ApiFunction build-MigrationFunction build-ReportFunction: function-package

function-package:
	mkdir -p "$(ARTIFACTS_DIR)"
	rm -rf "$(ARTIFACTS_DIR)/handler.py" "$(ARTIFACTS_DIR)/sql" "$(ARTIFACTS_DIR)/web"
	cp handler.py "$(ARTIFACTS_DIR)/handler.py"
	cp -R sql "$(ARTIFACTS_DIR)/sql"
	cp -R web "$(ARTIFACTS_DIR)/web"
	find "$(ARTIFACTS_DIR)/sql" "$(ARTIFACTS_DIR)/web" -mindepth 1 \( -name '__pycache__' -o -name '.*' -o -name '*.pyc' \) -prune -exec rm -rf {} +
	rm -rf "$(ARTIFACTS_DIR)/__pycache__"
	$(call compile_bytecode,$(ARTIFACTS_DIR)/handler.py,/var/task)

build-DependenciesLayer:
	@if [ -f "$(RDS_CA_BUNDLE)" ]; then \
		grep -q 'BEGIN CERTIFICATE' "$(RDS_CA_BUNDLE)" || { echo "ERROR: $(RDS_CA_BUNDLE) holds no PEM certificate." >&2; exit 1; }; \
		mkdir -p "$(ARTIFACTS_DIR)/certs" && \
		cp "$(RDS_CA_BUNDLE)" "$(ARTIFACTS_DIR)/certs/rds-global-bundle.pem"; \
	elif [ "$(ALLOW_MISSING_RDS_CA)" = "1" ]; then \
		echo "WARNING: $(RDS_CA_BUNDLE) not found; the layer has no RDS CA bundle (TLS to RDS will fail)." >&2; \
	else \
		echo "ERROR: RDS CA bundle $(RDS_CA_BUNDLE) not found. Put AWS's global-bundle.pem there, or set RDS_CA_BUNDLE=<path>." >&2; \
		exit 1; \
	fi
	@[ -f "$(LAYER_LOCK)" ] || { echo "ERROR: $(LAYER_LOCK) not found; run make lock." >&2; exit 1; }
	mkdir -p "$(ARTIFACTS_DIR)/python"
	$(PIP) install --requirement "$(LAYER_LOCK)" --require-hashes --no-deps --target "$(ARTIFACTS_DIR)/python" \
		$(addprefix --platform ,$(PIP_PLATFORMS)) --implementation cp --python-version $(LAMBDA_PYTHON_VERSION) \
		--only-binary=:all: --upgrade --no-compile --no-cache-dir --no-warn-conflicts --disable-pip-version-check
	rm -rf "$(ARTIFACTS_DIR)/python/bin"
	$(call compile_bytecode,$(ARTIFACTS_DIR)/python,/opt/python)

# requirements.lock from requirements.txt: every transitive dependency pinned, with the
# hashes of its published files, resolved for the Lambda runtime (uv, from PyPI).
lock:
	uv pip compile requirements.txt --generate-hashes --python-version $(LAMBDA_PYTHON_VERSION) \
		--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" \
		--output-file $(LAYER_LOCK)

# `sam local` end to end (docs/local-lambda.md): every event through `sam local invoke`
# and the README's curl walkthrough through `sam local start-api` (on 127.0.0.1 at
# SAM_LOCAL_PORT; 0: a free port), answers checked against the suite's; with no Lambda
# image in Docker it builds the TEST STAND-IN from local parts.
SAM_LOCAL_PORT ?= 0
.PHONY: sam-local
sam-local:
	python3 tools/sam_local.py --stand-in --port $(SAM_LOCAL_PORT)

# Developers' targets (docs/testing.md). Neither reads ARTIFACTS_DIR, so neither trips the
# check at the top. `make test` is the whole suite, as the README runs it; `make test-fast`
# leaves out the tests marked slow (package builds, the Lambda emulator, the stateful
# models); `make lint` is what CI lints with.
PYTHON ?= python3
.PHONY: test test-fast lint
test:
	$(PYTHON) -m pytest
test-fast:
	$(PYTHON) -m pytest -m "not slow"
lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) tests/ledger_lint.py
