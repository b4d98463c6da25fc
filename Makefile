# Build targets for `sam build` (template.yaml: Metadata BuildMethod: makefile).
# SAM copies the repository to a scratch directory, runs `make build-<LogicalId>`
# there and sets ARTIFACTS_DIR to the directory it packages for that resource.
#
# Functions: the package holds ONLY handler.py and sql/ (no caches, no dotfiles),
# so its content hash, which is the S3 key `sam deploy` uploads it under and so
# MigrationFunction's auto-published version, changes exactly when handler.py or
# sql/ change. Everything else (dependencies, the RDS CA bundle) is in the layer.
#
# Layer: requirements.txt minus test/lint tools, installed as manylinux wheels for
# the Lambda runtime, plus the RDS CA bundle at /opt/certs/rds-global-bundle.pem.

ARTIFACTS_DIR ?= $(error ARTIFACTS_DIR is not set; sam build sets it, or pass ARTIFACTS_DIR=<dir>)

PIP ?= python3 -m pip
LAMBDA_PYTHON_VERSION ?= 3.12
# Lambda python3.12 runs on Amazon Linux 2023 (glibc 2.34), x86_64.
PIP_PLATFORMS ?= manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64
# Where the operator put AWS's RDS global CA bundle (global-bundle.pem).
RDS_CA_BUNDLE ?= certs/rds-global-bundle.pem
# Set to 1 to build the layer without the CA bundle (sam local with DATABASE_URL only).
ALLOW_MISSING_RDS_CA ?= 0
# requirements.txt lines naming these packages are test/lint tools, not runtime.
DEV_PACKAGES ?= pytest|pytest[-_][A-Za-z0-9_.-]+|cfn-lint|ruff|mypy|coverage|moto|aws-sam-cli|aws-sam-translator|testcontainers

LAYER_REQUIREMENTS = $(ARTIFACTS_DIR)/.layer-requirements.txt

.PHONY: build-ApiFunction build-MigrationFunction build-ReportFunction build-DependenciesLayer function-package

build-ApiFunction build-MigrationFunction build-ReportFunction: function-package

function-package:
	mkdir -p "$(ARTIFACTS_DIR)"
	rm -rf "$(ARTIFACTS_DIR)/handler.py" "$(ARTIFACTS_DIR)/sql"
	cp handler.py "$(ARTIFACTS_DIR)/handler.py"
	cp -R sql "$(ARTIFACTS_DIR)/sql"
	find "$(ARTIFACTS_DIR)/sql" -mindepth 1 \( -name '__pycache__' -o -name '.*' -o -name '*.pyc' \) -prune -exec rm -rf {} +

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
	mkdir -p "$(ARTIFACTS_DIR)/python"
	grep -viE '^[[:space:]]*($(DEV_PACKAGES))[[:space:]]*([=<>!~;[@ ]|$$)' requirements.txt > "$(LAYER_REQUIREMENTS)" || true
	$(PIP) install --requirement "$(LAYER_REQUIREMENTS)" --target "$(ARTIFACTS_DIR)/python" \
		$(addprefix --platform ,$(PIP_PLATFORMS)) --implementation cp --python-version $(LAMBDA_PYTHON_VERSION) \
		--only-binary=:all: --upgrade --no-compile --no-cache-dir --no-warn-conflicts --disable-pip-version-check
	rm -f "$(LAYER_REQUIREMENTS)"
