# The two commands of the README, and a few helpers. Needs Python >= 3.11, Java 17 and Maven.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: install test-tools run cassandra cassandra-down cassandra-status test bench docs clean compose-tools images compose-test

# Real mail clients the tests drive (Debian packages; installed when missing, needs root or sudo).
TEST_TOOLS := swaks openssl getmail mbsync rspamd redis-server
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# A virtualenv with cassmail (editable) and its test tools; redone when pyproject.toml changes.
$(BIN)/cassmail: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/cassmail

# The mail server on the embedded mbox store under ./var/mail: SMTP 127.0.0.1:2525, submission :2587,
# POP3 :1110, IMAP :1143. Loopback only and no certificate, so logins in clear text are allowed here.
run: install
	$(BIN)/cassmail -o submission.allow_plaintext_auth=true -o pop3.allow_plaintext_auth=true \
	  -o imap.allow_plaintext_auth=true serve

# A local Apache Cassandra 5.0 node on 127.0.0.1:9042 (jars fetched once from Maven Central), schema applied.
cassandra: install
	$(BIN)/cassmail cassandra up

cassandra-down: install
	$(BIN)/cassmail cassandra down

cassandra-status: install
	$(BIN)/cassmail cassandra status

# The whole suite against a real Cassandra (its own node on 127.0.0.1:19042, started and stopped by the
# tests; or CASSMAIL_TEST_CASSANDRA=host:port), with the 1-node compose cluster in containers (so the
# container tools too). pytest's "no tests collected" (exit 5) is a failure.
test-tools:
	@missing=""; for t in $(TEST_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$(echo $$t | sed -e s/^getmail$$/getmail6/ -e s/^mbsync$$/isync/)"; done; \
	if [ -n "$$missing" ]; then echo "installing$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq$$missing >/dev/null; fi

# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set: the suite starts hundreds of Python
# processes (front ends, commands, load tools), each of which would compile cassmail's modules again.
test: install test-tools compose-tools
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The compose cluster in containers: podman (with runc) and debootstrap from Debian, Docker Compose v2
# from Debian's docker-compose package (trixie) unless the docker CLI has it; images built locally (deploy/images.py).
COMPOSE_TOOLS := podman runc debootstrap
compose-tools:
	@missing=""; for t in $(COMPOSE_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ] && ! docker version >/dev/null 2>&1; then echo "installing$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq$$missing >/dev/null; fi
	$(PYTHON) deploy/images.py compose

images: compose-tools
	$(PYTHON) deploy/images.py all

# Build the images, run `docker compose up` (COMPOSE_NODES=1 as in `test`; 3 or 5 add a Cassandra container
# stopped under load), mail in and out through the published ports, then `down -v`. Minutes.
COMPOSE_NODES ?= 1
compose-test: install images
	CASSMAIL_COMPOSE_NODES=$(COMPOSE_NODES) $(BIN)/python -m pytest -s -p no:cacheprovider tests/test_compose_run.py

# Store benchmark against the local node started by `make cassandra`.
bench: install
	$(BIN)/python loadtest/bench_store.py

# docs/configuration.md from the settings' definitions in cassmail/config.py (a test checks it is current).
docs: install
	$(BIN)/python -m cassmail.config reference --write

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
