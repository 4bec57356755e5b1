"""A bad value for every CLI flag and SHARPI_* environment variable (issue #10): exit code 2, exactly one
`error:` line on stderr naming the problem, no traceback. Cases tests/test_errors.py and tests/test_snapkv.py
already cover are left out (an unknown --target or --mcpu, --mcpu on vulkan, --adapter that matches nothing,
--snapkv-pooling on `run`, an unknown model name, a file that is not a GGUF, SHARPI_NUM_THREADS through the API,
SHARPI_SNAPKV_* through settings_from). Runs on a tiny llama (compiled once; the compile cache makes it fast)."""
from __future__ import annotations

import math

import pytest

import sharpi
from sharpi.cli import compile as compile_cli
from sharpi.cli import main as main_cli
from tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad-values")
    gguf = write_tiny_llama(root / "tiny.gguf")
    (root / "notes.txt").write_text("not a directory")
    (root / "busy").mkdir()
    (root / "busy" / "thesis.tex").write_text("someone's work")
    return {"gguf": str(gguf), "art": str(sharpi.compile(str(gguf), output=root / "tiny")),
            "file": str(root / "notes.txt"), "busy": str(root / "busy"), "tmp": str(root)}


RUN = ["run", "{art}", "-p", "hi", "-n", "1"]
COMPILE = ["{gguf}", "-o", "{tmp}/out", "--quiet"]

# id: (entry point, argv, environment, fragment of the one error line)
CLI_CASES = {
    # sharpi run / chat: sampling flags
    "run -n text": (main_cli, RUN + ["-n", "x"], {}, "invalid int value: 'x'"),
    "run -n negative": (main_cli, RUN + ["-n", "-1"], {}, "--max-tokens must be an integer in [0, "),
    "run --temperature text": (main_cli, RUN + ["--temperature", "hot"], {}, "invalid float value: 'hot'"),
    "run --temperature negative": (main_cli, RUN + ["--temperature", "-1"], {}, "temperature must be a finite number"),
    "run --temperature nan": (main_cli, RUN + ["--temperature", "nan"], {}, "temperature must be a finite number"),
    "run --top-k negative": (main_cli, RUN + ["--top-k", "-1"], {}, "top_k must be an integer in [0, "),
    "run --top-k fraction": (main_cli, RUN + ["--top-k", "1.5"], {}, "invalid int value: '1.5'"),
    "run --top-p zero": (main_cli, RUN + ["--top-p", "0"], {}, "top_p must be a number in (0, 1]"),
    "run --top-p above one": (main_cli, RUN + ["--top-p", "1.5"], {}, "top_p must be a number in (0, 1]"),
    "run --top-p nan": (main_cli, RUN + ["--top-p", "nan"], {}, "top_p must be a number in (0, 1]"),
    "run --min-p above one": (main_cli, RUN + ["--min-p", "2"], {}, "min_p must be a number in [0, 1]"),
    "run --min-p negative": (main_cli, RUN + ["--min-p", "-0.5"], {}, "min_p must be a number in [0, 1]"),
    "run --repeat-penalty zero": (main_cli, RUN + ["--repeat-penalty", "0"], {},
                                  "repeat_penalty must be a finite number > 0"),
    "run --seed negative": (main_cli, RUN + ["--seed", "-1"], {}, "seed must be an integer in [0, "),
    "run --seed text": (main_cli, RUN + ["--seed", "x"], {}, "invalid int value: 'x'"),
    # SnapKV flags at run time (--snapkv-pooling: tests/test_snapkv.py)
    "run --snapkv-budget negative": (main_cli, RUN + ["--snapkv-budget", "-5"], {}, "snapkv_budget must be"),
    "run --snapkv-budget text": (main_cli, RUN + ["--snapkv-budget", "lots"], {}, "snapkv_budget must be"),
    "run --snapkv-window zero": (main_cli, RUN + ["--snapkv-window", "0"], {},
                                 "snapkv_window must be an integer in [1, 4096]"),
    "run --snapkv-window too big": (main_cli, RUN + ["--snapkv-window", "1000"], {}, "exceeds the window"),
    "run --snapkv-recency text": (main_cli, RUN + ["--snapkv-recency", "x"], {}, "snapkv_recency must be an integer"),
    "run --snapkv-recency >= budget": (main_cli, RUN + ["--snapkv-budget", "100", "--snapkv-recency", "100"], {},
                                       "must be smaller than the budget"),
    "run --snapkv-kernel even": (main_cli, RUN + ["--snapkv-kernel", "4"], {}, "must be odd"),
    "run --snapkv-granularity": (main_cli, RUN + ["--snapkv-granularity", "head"], {}, "kv-head, shared"),
    "run --snapkv-sinks negative": (main_cli, RUN + ["--snapkv-sinks", "-1"], {},
                                    "snapkv_sinks must be an integer in [0, "),
    "run --snapkv-sinks text": (main_cli, RUN + ["--snapkv-sinks", "few"], {}, "snapkv_sinks must be an integer"),
    "run --snapkv-recency + sinks >= budget": (main_cli, RUN + ["--snapkv-budget", "100", "--snapkv-recency", "64",
                                                                "--snapkv-sinks", "36"], {},
                                               "recency + sinks (64 + 36) must be smaller than the budget (100)"),
    # device flags
    "run --threads zero": (main_cli, RUN + ["--threads", "0"], {}, "threads must be an integer in [1, 1024]"),
    "run --threads text": (main_cli, RUN + ["--threads", "x"], {}, "invalid int value: 'x'"),
    "run --adapter on llvm": (main_cli, RUN + ["--adapter", "gpu"], {}, "applies to Vulkan artifacts only"),
    # arguments
    "run empty prompt": (main_cli, ["run", "{art}", "-p", ""], {}, "The prompt is empty"),
    "run no prompt": (main_cli, ["run", "{art}"], {}, "Give the prompt with -p TEXT or --file PATH"),
    "run missing artifact": (main_cli, ["run", "{tmp}/nowhere", "-p", "hi"], {}, "is not a sharpi artifact"),
    "run artifact is a file": (main_cli, ["run", "{file}", "-p", "hi"], {}, "is not a sharpi artifact"),
    "run unknown flag": (main_cli, RUN + ["--bogus"], {}, "Unrecognized arguments: --bogus"),
    "no command": (main_cli, [], {}, "required: command"),
    "unknown command": (main_cli, ["frobnicate"], {}, "invalid choice: 'frobnicate'"),
    "chat --temperature negative": (main_cli, ["chat", "{art}", "--temperature", "-1"], {},
                                    "temperature must be a finite number >= 0"),
    "chat --snapkv-kernel even": (main_cli, ["chat", "{art}", "--snapkv-kernel", "2"], {}, "must be odd"),
    "chat -n negative": (main_cli, ["chat", "{art}", "-n", "-3"], {}, "--max-tokens must be an integer in [0, "),
    "inspect missing file": (main_cli, ["inspect", "{tmp}/nowhere.gguf"], {}, "no such file"),
    # sharpi bench
    "bench --prompt-tokens zero": (main_cli, ["bench", "{art}", "--prompt-tokens", "0"], {},
                                   "--prompt-tokens must be an integer in [1, "),
    "bench --gen-tokens negative": (main_cli, ["bench", "{art}", "--gen-tokens", "-1"], {},
                                    "--gen-tokens must be an integer in [0, "),
    "bench --repeats zero": (main_cli, ["bench", "{art}", "--repeats", "0"], {},
                             "--repeats must be an integer in [1, "),
    "bench --gguf missing": (main_cli, ["bench", "{art}", "--compare-llama-cpp", "--gguf", "{tmp}/none.gguf"], {},
                             "does not exist"),
    # sharpi-compile
    "compile --max-context text": (compile_cli, COMPILE + ["--max-context", "long"], {}, "invalid int value"),
    "compile --max-context zero": (compile_cli, COMPILE + ["--max-context", "0"], {},
                                   "--max-context must be an integer in [1, "),
    "compile --max-context too long": (compile_cli, COMPILE + ["--max-context", "100000"], {},
                                       "exceeds the model's context of 256"),
    "compile --kv-dtype": (compile_cli, COMPILE + ["--kv-dtype", "f8"], {}, "--kv-dtype must be one of f32, f16, bf16"),
    "compile --kv-dtype bf16 on vulkan": (compile_cli, COMPILE + ["--target", "vulkan", "--kv-dtype", "bf16"], {},
                                          "bf16 is not available on the vulkan target"),
    "compile --snapkv": (compile_cli, COMPILE + ["--snapkv", "maybe"], {}, "--snapkv must be 'on' or 'off'"),
    "compile --snapkv-budget": (compile_cli, COMPILE + ["--snapkv-budget", "-1"], {}, "snapkv_budget must be"),
    "compile --snapkv-window": (compile_cli, COMPILE + ["--snapkv-window", "0"], {},
                                "snapkv_window must be an integer in [1, 4096]"),
    "compile --snapkv-recency": (compile_cli, COMPILE + ["--snapkv-recency", "-1"], {},
                                 "snapkv_recency must be an integer in [0, "),
    "compile --snapkv-pooling": (compile_cli, COMPILE + ["--snapkv-pooling", "median"], {}, "max, avg, none"),
    "compile --snapkv-kernel": (compile_cli, COMPILE + ["--snapkv-kernel", "8"], {}, "must be odd"),
    "compile --snapkv-granularity": (compile_cli, COMPILE + ["--snapkv-granularity", "x"], {}, "kv-head, shared"),
    "compile --snapkv-sinks": (compile_cli, COMPILE + ["--snapkv-sinks", "-2"], {},
                               "snapkv_sinks must be an integer in [0, "),
    "compile --snapkv-sinks >= budget": (compile_cli, COMPILE + ["--snapkv-budget", "32", "--snapkv-recency", "16",
                                                                 "--snapkv-sinks", "16"], {},
                                         "must be smaller than the budget (32)"),
    "compile --arch on llvm": (compile_cli, COMPILE + ["--arch", "sm_90"], {}, "--arch applies to the cuda target"),
    "compile --cuda-graph on llvm": (compile_cli, COMPILE + ["--cuda-graph"], {}, "--cuda-graph applies to the cuda"),
    "compile -o over other files": (compile_cli, ["{gguf}", "-o", "{busy}", "--quiet"], {},
                                    "is not empty and is not a sharpi artifact"),
    "compile -o is a file": (compile_cli, ["{gguf}", "-o", "{file}", "--quiet"], {}, "exists and is not a folder"),
    "compile -o under a file": (compile_cli, ["{gguf}", "-o", "{file}/out", "--quiet", "--no-cache"], {},
                                "is a file, not a folder"),
    "compile -o under a file, cached": (compile_cli, ["{gguf}", "-o", "{file}/out", "--quiet"], {},
                                        "is a file, not a folder"),
    "compile --dump-ir unwritable": (compile_cli, COMPILE + ["--dump-ir", "{tmp}/no/such/dir/ir.txt"], {},
                                     "--dump-ir"),
    "compile missing model": (compile_cli, ["{tmp}/nowhere.gguf", "--quiet"], {}, "no such file"),
    "compile no model": (compile_cli, [], {}, "required: model"),
    # environment variables (SHARPI_SNAPKV_* and SHARPI_NUM_THREADS through the CLI)
    "SHARPI_HOME empty": (main_cli, ["fetch", "smollm2-135m"], {"SHARPI_HOME": ""}, "SHARPI_HOME is set but empty"),
    "SHARPI_HOME is a file": (compile_cli, COMPILE, {"SHARPI_HOME": "{file}"}, "must be a folder sharpi can write to"),
    "SHARPI_NUM_THREADS text": (main_cli, RUN, {"SHARPI_NUM_THREADS": "many"}, "SHARPI_NUM_THREADS must be an"),
    "SHARPI_NUM_THREADS negative": (main_cli, RUN, {"SHARPI_NUM_THREADS": "-2"},
                                    "SHARPI_NUM_THREADS must be an integer in [1, 1024]"),
    "SHARPI_SNAPKV_BUDGET": (main_cli, RUN, {"SHARPI_SNAPKV_BUDGET": "lots"}, "SHARPI_SNAPKV_BUDGET must be"),
    "SHARPI_SNAPKV_WINDOW": (main_cli, RUN, {"SHARPI_SNAPKV_WINDOW": "0"},
                             "SHARPI_SNAPKV_WINDOW must be an integer in [1, 4096]"),
    "SHARPI_SNAPKV_RECENCY": (main_cli, RUN, {"SHARPI_SNAPKV_RECENCY": "-3"},
                              "SHARPI_SNAPKV_RECENCY must be an integer in [0, "),
    "SHARPI_SNAPKV_POOLING": (main_cli, RUN, {"SHARPI_SNAPKV_POOLING": "median"}, "SHARPI_SNAPKV_POOLING must be"),
    "SHARPI_SNAPKV_KERNEL": (main_cli, RUN, {"SHARPI_SNAPKV_KERNEL": "6"}, "SHARPI_SNAPKV_KERNEL must be odd"),
    "SHARPI_SNAPKV_GRANULARITY": (main_cli, RUN, {"SHARPI_SNAPKV_GRANULARITY": "x"}, "SHARPI_SNAPKV_GRANULARITY"),
    "SHARPI_SNAPKV_SINKS": (main_cli, RUN, {"SHARPI_SNAPKV_SINKS": "-1"},
                            "SHARPI_SNAPKV_SINKS must be an integer in [0, "),
}


def _fill(value: str, paths: dict) -> str:
    return value.format(**paths)


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_bad_value_is_one_error_line_and_exit_2(case, paths, monkeypatch, capsys):
    entry, argv, env, fragment = CLI_CASES[case]
    for name in ("SHARPI_NUM_THREADS", *[f"SHARPI_SNAPKV_{k}" for k in
                                        ("BUDGET", "WINDOW", "RECENCY", "POOLING", "KERNEL", "GRANULARITY",
                                         "SINKS")]):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, _fill(value, paths))
    code = entry.main([_fill(a, paths) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert fragment in lines[0], lines[0]


def test_vulkan_adapter_env_var(paths, monkeypatch, capsys):
    """SHARPI_VULKAN_ADAPTER naming no adapter (the --adapter flag is in tests/test_errors.py)."""
    from sharpi.runtime.vulkan import VulkanUnavailableError, list_adapters
    try:
        list_adapters()
    except VulkanUnavailableError:
        pytest.skip("no Vulkan driver here (wgpu found no adapter)")
    artifact = sharpi.compile(paths["gguf"], target="vulkan", output=f"{paths['tmp']}/tiny-vk")
    monkeypatch.setenv("SHARPI_VULKAN_ADAPTER", "no-such-gpu-anywhere")
    code = main_cli.main(["run", str(artifact), "-p", "hi", "-n", "1"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "No Vulkan" in lines[0], lines


# Python API values the CLI cannot produce (its flags are typed) or that reach the API unchecked elsewhere
API_CASES = {
    "load threads zero": (lambda m, p: sharpi.load(p, threads=0), "threads must be an integer in [1, 1024]"),
    "load pool_sequences zero": (lambda m, p: sharpi.load(p, pool_sequences=0),
                                 "pool_sequences must be an integer in [1, 4096]"),
    "load pool_sequences text": (lambda m, p: sharpi.load(p, pool_sequences="many"), "pool_sequences must be an"),
    "load adapter on llvm": (lambda m, p: sharpi.load(p, adapter="gpu"), "applies to Vulkan artifacts only"),
    "generate seed negative": (lambda m, p: m.generate("hi", max_tokens=1, seed=-1), "seed must be"),
    "generate seed fraction": (lambda m, p: m.generate("hi", max_tokens=1, seed=1.5), "seed must be"),
    "generate max_tokens text": (lambda m, p: m.generate("hi", max_tokens="8"), "max_tokens must be"),
    "generate temperature nan": (lambda m, p: m.generate("hi", max_tokens=1, temperature=math.nan), "temperature"),
    "generate unknown option": (lambda m, p: m.generate("hi", max_tokens=1, beam_width=4), "Unknown option"),
    "session snapkv option": (lambda m, p: m.session(snapkv_budget="x"), "snapkv_budget must be"),
    "session snapkv_sinks negative": (lambda m, p: m.session(snapkv_sinks=-1),
                                      "snapkv_sinks must be an integer in [0, "),
}


@pytest.fixture(scope="module")
def tiny_model(paths):
    return sharpi.load(paths["art"])


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_bad_value_is_a_config_error(case, paths, tiny_model):
    call, fragment = API_CASES[case]
    with pytest.raises(sharpi.ConfigError) as info:
        call(tiny_model, paths["art"])
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)
