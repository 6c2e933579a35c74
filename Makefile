# Set-up, tests and demo for layerfs. Every target installs what is missing
# (Debian packages, a virtualenv with layerfs installed editable) and is quick
# when it is already there.

# The venvs' interpreter: the system's where there is one, so that other users
# can run what is installed (a per-user pyenv python on PATH is not theirs).
# A venv made by another interpreter is made again.
PYTHON  ?= $(firstword $(wildcard /usr/bin/python3) python3)
PYTHON_REAL := $(shell readlink -f "$$(command -v $(PYTHON))")
VENV    ?= .venv
PY      := $(VENV)/bin/python
# named by the interpreter: a venv made by another one is made again
STAMP   := $(VENV)/.installed$(subst /,-,$(PYTHON_REAL))
APT_PKGS := fuse3 libfuse3-dev pkg-config erofs-utils busybox-static attr zstd tar \
            qemu-utils e2fsprogs util-linux runc crun passwd gcc libc6-dev python3-dev \
            python3-venv docker-registry apache2-utils skopeo umoci containerd debootstrap \
            btrfs-progs systemd-container qemu-system-x86

# `make install`: a venv in PREFIX with the wheel, the command linked into
# BINDIR, the systemd unit in UNITDIR and its environment file (kept if there)
# in CONFDIR (docs/deploy.md).
PREFIX  ?= /opt/layerfs
BINDIR  ?= /usr/local/bin
UNITDIR ?= /etc/systemd/system
CONFDIR ?= /etc/layerfs
DIST    ?= dist

.PHONY: all deps apt-deps test test-fast demo lint bench-build wheel install protos clean

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
	@[ "$$(readlink -f $(VENV)/bin/python)" = "$(PYTHON_REAL)" ] || { \
	  echo "making $(VENV) with $(PYTHON_REAL)"; $(PYTHON) -m venv --clear $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed*
	touch $(STAMP)

deps: apt-deps $(STAMP)

# The lint runs first; it lives in tests/test_lint.py (ruff, and mypy on the
# package as installed, so imports between the four folders are checked).
# The suite runs on TEST_WORKERS pytest-xdist workers, a test file per worker
# at a time (its module fixtures are built once); each worker has its own
# SeaweedFS, registry and temporary directories (tests/conftest.py). Two
# workers a core: most tests spend most of their time waiting (on daemons,
# servers, guests, timeouts), so a core has room for a second one.
NPROC        := $(shell nproc 2>/dev/null || echo 1)
TEST_WORKERS ?= $(shell echo $$(( 2 * $(NPROC) )))
test: lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 --ignore=tests/test_lint.py

# The unit tier: no server, daemon or root-only work (tests/conftest.py marks
# it), without the lint; skips are not listed. Its tests keep the CPU busy:
# a worker a core (FAST_WORKERS).
FAST_WORKERS ?= $(NPROC)
test-fast: deps
	$(VENV)/bin/pytest -q -n $(FAST_WORKERS) --dist loadfile -m fast -rfE --ignore=tests/test_lint.py

demo: deps
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash demo/demo.sh

lint: deps
	$(VENV)/bin/pytest -q tests/test_lint.py

# containerd's snapshots API as checked-in Python code (layerfs/node/containerd/api/: the
# .proto files are containerd 1.6's, gogoproto options removed); run after editing them.
CTRDAPI := layerfs/node/containerd/api
protos: deps
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
	  $(CTRDAPI)/mount.proto $(CTRDAPI)/snapshots.proto

bench-build: deps
	$(PY) -m bench.build

# The wheel, with the compiled check (_erofscheck), built from the dev venv's
# setuptools (no download).
wheel: deps
	rm -f $(DIST)/layerfs-*.whl
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(DIST) .

# An upgrade is `make install` again, then `systemctl restart layerfs` (a live
# restart: the sandboxes stay up). The wheel's version does not change
# between builds, hence the reinstall without dependencies.
install: wheel
	umask 022; [ "$$(readlink -f $(PREFIX)/bin/python)" = "$(PYTHON_REAL)" ] || \
	  $(PYTHON) -m venv --clear $(PREFIX)
	umask 022; $(PREFIX)/bin/python -m pip install -q --root-user-action=ignore \
	  --upgrade pip
	umask 022; $(PREFIX)/bin/python -m pip install -q --root-user-action=ignore \
	  $(DIST)/layerfs-*.whl
	umask 022; $(PREFIX)/bin/python -m pip install -q --root-user-action=ignore \
	  --force-reinstall --no-deps $(DIST)/layerfs-*.whl
	install -d $(BINDIR) $(UNITDIR) $(CONFDIR)
	ln -sfn $(PREFIX)/bin/layerfs $(BINDIR)/layerfs
	sed -e 's|/usr/local/bin/layerfs|$(BINDIR)/layerfs|' \
	  -e 's|/etc/layerfs/daemon.env|$(CONFDIR)/daemon.env|' deploy/systemd/layerfs.service \
	  > $(UNITDIR)/layerfs.service
	chmod 0644 $(UNITDIR)/layerfs.service
	[ -e $(CONFDIR)/daemon.env ] || \
	  install -m 0600 deploy/systemd/daemon.env $(CONFDIR)/daemon.env
	if [ "$(UNITDIR)" = /etc/systemd/system ] && [ -d /run/systemd/system ]; then \
	  systemctl daemon-reload; fi

clean:
	rm -rf $(VENV) .pytest_cache $(DIST) build
