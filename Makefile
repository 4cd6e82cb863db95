# kernscope — the two commands:
#   make run    set up a fresh machine, build, fetch SmolLM2 and generate text (CPU; CUDA if a GPU is there)
#   make test   set up, build and run every test (the CI entry point)
BUILD     ?= build
CMAKE_ARGS ?=
PROMPT    ?= Give three tips for staying healthy.
MAX_TOKENS ?= 200
export KS_CACHE ?= $(HOME)/.cache/kernscope
MODEL     ?= $(KS_CACHE)/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: all setup configure build build-ksctl model test test-bindings run bench clean
all: build

setup:
	@scripts/setup.sh

configure: setup
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)

build: configure
	cmake --build $(BUILD)

# ksctl and the library only (what `make run` and `make bench` use; the tests are not built)
build-ksctl: configure
	cmake --build $(BUILD) --target ksctl

# MODEL set to a file of your own: nothing is fetched (it must exist)
model:
	@if [ "$(MODEL)" = "$(KS_CACHE)/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then scripts/fetch_model.sh >/dev/null || exit 1; \
	  elif [ ! -f "$(MODEL)" ]; then echo "MODEL=$(MODEL): no such file" >&2; exit 1; fi; \
	  echo "model: $(MODEL)"

# Tests run two at a time, each with OpenMP threads: passive waiting keeps them
# from spinning against each other (speed is measured by `make bench`, not here).
test: build model
	OMP_WAIT_POLICY=passive KS_MODEL_PATH="$(MODEL)" KS_REQUIRE_MODEL=1 ctest --test-dir $(BUILD) --output-on-failure -j 2
	@scripts/setup_bindings.sh
	bindings/run_tests.sh $(BUILD)
	scripts/setup_python.sh $(BUILD)/python-venv
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(BUILD)/python-venv/bin/python -m pip install -q --no-build-isolation --no-deps \
	  --no-index --disable-pip-version-check -C build-dir=$(BUILD)/python-build -C cmake.define.KS_WITH_CUDA=OFF .
	PYTHONDONTWRITEBYTECODE=1 $(BUILD)/python-venv/bin/python -m pytest -q -p no:cacheprovider tests/python

test-bindings: build
	@scripts/setup_bindings.sh
	bindings/run_tests.sh $(BUILD)

# The prompt reaches ksctl through a shell variable set first (a `VAR=x cmd "$VAR"` prefix
# would expand $VAR before the assignment: an empty prompt), unexpanded and unquoted by make
# or the shell (quotes, $ and backticks in PROMPT are passed as written). ksctl picks the thread
# count from the cores' load (README, Threads); an OMP_WAIT_POLICY here would turn that off.
run: build-ksctl model
	@KS_PROMPT='$(subst ','\'',$(value PROMPT))'; \
	  $(BUILD)/ksctl generate --model "$(MODEL)" --chat --max-tokens $(MAX_TOKENS) --prompt "$$KS_PROMPT"

# The CSV goes to $(BENCH_CSV): the build folder by default, so a run on another machine does not
# overwrite the checked-in record (docs/perf/cpu.csv: `make bench BENCH_CSV=docs/perf/cpu.csv`).
BENCH_CSV ?= $(BUILD)/bench_cpu.csv
bench: build-ksctl model
	OMP_WAIT_POLICY=passive $(BUILD)/ksctl bench-model --model "$(MODEL)" --prompt-tokens 64 512 --decode-tokens 128 \
	  --repeats 5 --csv $(BENCH_CSV)

clean:
	rm -rf $(BUILD)
