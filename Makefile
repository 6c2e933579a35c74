# Set-up, tests and demo for layerfs. Every target installs what is missing
# (Debian packages, a virtualenv with layerfs installed editable) and is quick
# when it is already there.

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
APT_PKGS := fuse3 libfuse3-dev pkg-config erofs-utils busybox-static attr zstd tar \
            qemu-utils e2fsprogs util-linux runc crun passwd gcc libc6-dev python3-dev \
            docker-registry apache2-utils skopeo umoci containerd debootstrap \
            btrfs-progs

.PHONY: all deps apt-deps test test-fast demo lint bench-build protos clean

all: test

apt-deps:
	@missing=""; for p in $(APT_PKGS); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# The compiled check is built with -Werror only when CI=true (setup.py).
$(STAMP): pyproject.toml setup.py layerfs/formats/_erofscheck.c | apt-deps
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

deps: apt-deps $(STAMP)

# The lint runs first; it lives in tests/test_lint.py (ruff, and mypy on the
# package as installed, so imports between the four folders are checked).
# The suite runs on TEST_WORKERS pytest-xdist workers, a test file per worker
# at a time (its module fixtures are built once); each worker has its own
# SeaweedFS, registry and temporary directories (tests/conftest.py).
TEST_WORKERS ?= 2
test: lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --ignore=tests/test_lint.py

# The unit tier: no server, daemon or root-only work (tests/conftest.py marks
# it), without the lint; skips are not listed.
test-fast: deps
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile -m fast -rfE --ignore=tests/test_lint.py

demo: deps
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash demo/demo.sh

lint: deps
	$(VENV)/bin/pytest -q tests/test_lint.py

# containerd's snapshots API as checked-in Python code (layerfs/node/ctrdapi/: the
# .proto files are containerd 1.6's, gogoproto options removed); run after editing them.
CTRDAPI := layerfs/node/ctrdapi
protos: deps
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
	  $(CTRDAPI)/mount.proto $(CTRDAPI)/snapshots.proto

bench-build: deps
	$(PY) bench/build.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy-src
