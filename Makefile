# Two commands from a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0   # the CPU build; an unpinned torch pulls CUDA (GBs)
	$(PY) -m pip install -q -e '.[test,livekit,pipecat]'
	touch $@

install: $(VENV)/.installed

engines/cpu-tiny/manifest.json: $(VENV)/.installed charengine/targets/cpu-tiny.toml charengine/checkpoints/tiny.safetensors $(wildcard charengine/*.py charengine/characters/*.py builder/*.py)
	$(BIN)/charbuild --target cpu-tiny --out engines/cpu-tiny

demo: engines/cpu-tiny/manifest.json
	$(BIN)/charrun --engine engines/cpu-tiny --image assets/face.png --audio assets/speech.wav \
		--prompt "a cheerful cartoon character" --out out/demo.mp4

assets: $(VENV)/.installed
	$(PY) scripts/make_demo_media.py --out assets

test: $(VENV)/.installed
	@echo "make test: 16 to 40 minutes on 2 cores (the browser and image tests run as root)"
	$(PY) -m pytest -q

.PHONY: install demo assets test
