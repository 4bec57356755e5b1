"""The reliability issue's smaller classes, several members each: non-finite weights and logits, sampling at
extreme values, wrong types for the API's arguments, knobs past the range the kernels honour, an unusable
SHARPI_HOME, a GGUF whose vocabulary and embeddings disagree. Compiles use the tiny llama with a stand-in LLVM
build (tests/tiny_gguf.py: the tiny artifact's kernels, so a GGUF of the same shapes and types loads and runs)."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import sharpi
from sharpi.cli import compile as compile_cli
from sharpi.cli import main as main_cli
from sharpi.runtime.sampling import Sampler, SamplingParams
from sharpi.codegen.targets.llvm import TARGET as LLVM
from tiny_gguf import fake_llvm_build, write_tiny_llama


@pytest.fixture
def fake_build(tiny_artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARPI_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(LLVM, "build", fake_llvm_build(tiny_artifact))


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


# -- non-finite weights: a warning at compile time, one error at run time ------------------------------------------
def _poisoned(path: Path, name: str, value: float, **kwargs) -> Path:
    """The tiny llama with one weight of tensor `name` set to `value` (NaN or an infinity)."""
    import gguf
    clean = write_tiny_llama(path.with_name("clean-" + path.name), **kwargs)
    reader = gguf.GGUFReader(str(clean))
    tensor = next(t for t in reader.tensors if t.name == name)
    data = np.array(tensor.data, dtype=np.float32)
    data.flat[3] = value                                  # token 0's embedding, or row 0 of a matrix
    return write_tiny_llama(path, override_raw={name: (data, gguf.GGMLQuantizationType.F32)}, **kwargs)


@pytest.mark.parametrize("name, value", [("output_norm.weight", float("nan")), ("blk.0.attn_q.weight", float("inf")),
                                         ("blk.1.ffn_down.weight", -float("inf")),
                                         ("token_embd.weight", float("nan"))])
def test_non_finite_weights_warn_at_compile_and_stop_at_run(name, value, fake_build, tmp_path, capsys):
    gguf_path = _poisoned(tmp_path / "poisoned.gguf", name, value)
    with pytest.warns(sharpi.SharpiWarning) as record:
        art = sharpi.compile(str(gguf_path), output=tmp_path / "art", use_cache=False)
    assert any(name in str(w.message) and "NaN or infinite" in str(w.message) for w in record)
    model = sharpi.load(art)
    ids = [0, 3, 5]                                       # token 0 (byte 0x00): the poisoned embedding row
    with pytest.raises(sharpi.NonFiniteLogitsError, match="logits are not finite"):
        model.generate(ids, max_tokens=4)
    with pytest.raises(sharpi.NonFiniteLogitsError):
        model.score(ids)
    assert main_cli.main(["run", str(art), "-p", "\x00\x03", "-n", "2"]) == 2
    assert "logits are not finite" in _one_error_line(capsys.readouterr().err)


def test_compile_cli_prints_the_warning_as_one_line(fake_build, tmp_path, capsys):
    gguf_path = _poisoned(tmp_path / "poisoned.gguf", "output_norm.weight", float("nan"))
    assert compile_cli.main([str(gguf_path), "-o", str(tmp_path / "art"), "--quiet", "--no-cache"]) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and "output_norm.weight" in warning[0] and "Traceback" not in err


def test_a_mislabelled_quantized_tensor_is_flagged(fake_build, tmp_path):
    """Bytes of another type labelled Q8_0: its f16 scales read as NaN and infinities."""
    import gguf
    raw = np.full((64, 34 * 2), 0xFF, np.uint8)           # 64 rows of 2 Q8_0 blocks, every scale 0xFFFF (NaN)
    path = write_tiny_llama(tmp_path / "mislabelled.gguf",
                            override_raw={"blk.0.attn_q.weight": (raw, gguf.GGMLQuantizationType.Q8_0)})
    with pytest.warns(sharpi.SharpiWarning, match="blk.0.attn_q.weight"):
        sharpi.compile(str(path), output=tmp_path / "art", use_cache=False)


# -- sampling ---------------------------------------------------------------------------------------------------
EXTREME = [dict(temperature=1e-300), dict(temperature=1e-30, top_k=5), dict(temperature=5e-324, top_p=0.5),
           dict(temperature=1.0, repeat_penalty=1e-300), dict(temperature=1e-300, repeat_penalty=1e-300, min_p=1.0),
           dict(temperature=1e300), dict(temperature=1.0, top_p=1e-300), dict(temperature=0.7, min_p=1e-300),
           dict(temperature=0.0, repeat_penalty=1e-300), dict(temperature=2.0, repeat_penalty=1e300)]


@pytest.mark.parametrize("params", EXTREME, ids=[str(p) for p in EXTREME])
def test_sampling_is_numerically_safe_for_every_accepted_value(params):
    rng = np.random.default_rng(0)
    for scale in (1.0, 1e3, 1e38):
        logits = np.clip(rng.standard_normal(257) * scale, -3.4e38, 3.4e38).astype(np.float32)   # finite float32
        sampler = Sampler(SamplingParams(seed=1, **params))
        with warnings.catch_warnings():
            warnings.simplefilter("error")                 # no overflow or invalid-value RuntimeWarnings either
            tokens = [sampler(logits, history=[1, 2, 3, int(np.argmax(logits))]) for _ in range(5)]
        assert all(0 <= t < 257 for t in tokens)


@pytest.mark.parametrize("params, message", [
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(temperature=True), "temperature must be a finite number"),
    (dict(repeat_penalty=float("inf")), "repeat_penalty must be a finite number"),
    (dict(repeat_penalty=float("nan")), "repeat_penalty"),
    (dict(top_k=True), "top_k must be an integer"),
    (dict(top_k=2.0), "top_k must be an integer"),
    (dict(top_p="0.5"), "top_p must be a number"),
    (dict(seed=2**64), "seed must be an integer in [0, "),
    (dict(seed=1.0), "seed must be an integer"),
])
def test_sampling_values_out_of_range_are_config_errors(params, message):
    with pytest.raises(sharpi.ConfigError) as info:
        SamplingParams(**params).validate()
    assert message in str(info.value)


# -- the Python API's argument types ------------------------------------------------------------------------------
@pytest.mark.parametrize("call, message", [
    (lambda m: m.generate(b"abc", max_tokens=1), "must be a sequence of integer token ids, got bytes"),
    (lambda m: m.generate([1.5, 2.0], max_tokens=1), "must hold integer token ids, got 1.5"),
    (lambda m: m.generate([True, 2], max_tokens=1), "must hold integer token ids, got True"),
    (lambda m: m.generate(None, max_tokens=1), "got NoneType"),
    (lambda m: m.generate(5, max_tokens=1), "got int"),
    (lambda m: m.generate({"a": 1}, max_tokens=1), "got dict"),
    (lambda m: m.generate([1, 2], max_tokens=1, stop=123), "stop must be a string or a list of strings"),
    (lambda m: m.generate([1, 2], max_tokens=1, stop=["a", 1]), "stop must be a string or a list of strings"),
    (lambda m: m.generate([1, 2], max_tokens=1, special="yes"), "special must be True or False"),
    (lambda m: m.generate([1, 2], max_tokens=2**40), "max_tokens must be an integer in [0, "),
    (lambda m: m.generate([1, 2], max_tokens=None), "max_tokens must be an integer"),
    (lambda m: m.generate([1, 10**6], max_tokens=1), "Token ids must be in [0, 257)"),
    (lambda m: m.score(b"abc"), "Token ids must be a non-empty 1-D sequence of integers"),
    (lambda m: m.score([1.0, 2.0]), "Token ids must be a non-empty 1-D sequence of integers"),
    (lambda m: m.detokenize([1.5]), "must hold integer token ids, got 1.5"),
    (lambda m: m.detokenize("abc"), "got str"),
    (lambda m: m.tokenize(None), "tokenize() takes a str"),
    (lambda m: m.session().decode("5"), "Token ids must be a non-empty 1-D sequence of integers"),
])
def test_wrong_argument_types_are_one_sentence(call, message, tiny_artifact):
    model = sharpi.load(tiny_artifact)
    with pytest.raises(sharpi.SharpiError) as info:
        call(model)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


# -- knobs past the range the kernels honour -----------------------------------------------------------------------
@pytest.mark.parametrize("argv, env, message", [
    (["run", "{art}", "-p", "hi", "--snapkv-kernel", str(2**31 + 1)], {}, "snapkv_kernel must be an integer in [1, "),
    (["run", "{art}", "-p", "hi", "--snapkv-kernel", str(2**31 - 1)], {}, "snapkv_kernel must be an integer in [1, "),
    (["run", "{art}", "-p", "hi"], {"SHARPI_SNAPKV_KERNEL": str(2**31 + 1)}, "SHARPI_SNAPKV_KERNEL must be an integer"),
    (["run", "{art}", "-p", "hi", "--snapkv-window", "100000"], {}, "snapkv_window must be an integer in [1, 4096]"),
    (["run", "{art}", "-p", "hi", "--snapkv-budget", str(2**40)], {}, "or an integer in [1, 16777216]"),
    (["run", "{art}", "-p", "hi", "--threads", "100000"], {}, "threads must be an integer in [1, 1024]"),
    (["run", "{art}", "-p", "hi"], {"SHARPI_NUM_THREADS": "99999999999"}, "SHARPI_NUM_THREADS must be an integer"),
    (["run", "{art}", "-p", "hi", "-n", str(2**40)], {}, "--max-tokens must be an integer in [0, 2147483647]"),
    (["bench", "{art}", "--repeats", str(2**40)], {}, "--repeats must be an integer in [1, "),
    (["run", "{art}", "-p", "hi", "--expect-sha256", "abc"], {}, "expect_sha256 must be a sha256"),
])
def test_knobs_out_of_range_are_one_line_with_the_range(argv, env, message, tiny_artifact, monkeypatch, capsys):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main_cli.main([a.replace("{art}", str(tiny_artifact)) for a in argv]) == 2
    assert message in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("flags, message", [
    (["--snapkv-kernel", str(2**31 + 1)], "snapkv_kernel must be an integer in [1, 255]"),
    (["--snapkv-window", "5000"], "snapkv_window must be an integer in [1, 4096]"),
    (["--max-context", str(2**40)], "--max-context must be an integer in [1, "),
])
def test_compiled_in_defaults_are_bounded_too(flags, message, fake_build, tiny_gguf, tmp_path, capsys):
    assert compile_cli.main([str(tiny_gguf), "-o", str(tmp_path / "a"), "--quiet"] + flags) == 2
    assert message in _one_error_line(capsys.readouterr().err)


def test_api_knobs_out_of_range(tiny_artifact, monkeypatch):
    with pytest.raises(sharpi.ConfigError, match=r"pool_sequences must be an integer in \[1, 4096\]"):
        sharpi.load(tiny_artifact, pool_sequences=10**9)
    with pytest.raises(sharpi.ConfigError, match=r"snapkv_kernel must be an integer in \[1, 255\]"):
        sharpi.load(tiny_artifact).session(snapkv_budget=64, snapkv_kernel=2**31 + 1)
    monkeypatch.setenv("SHARPI_CACHE_GB", "1e300")
    from sharpi import compile_cache
    with pytest.raises(sharpi.ConfigError, match=r"SHARPI_CACHE_GB must be a positive number of GiB, in \(0, "):
        compile_cache.limit_bytes()


# -- SHARPI_HOME, GGUF consistency, format versions ------------------------------------------------------------------
@pytest.mark.parametrize("home", ["a file", "under a file"])
@pytest.mark.parametrize("command", [["fetch", "smollm2-135m"], "compile"])
def test_an_unusable_sharpi_home_is_one_sentence(home, command, tmp_path, monkeypatch, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    monkeypatch.setenv("SHARPI_HOME", str(notes if home == "a file" else notes / "home"))
    if command == "compile":
        code = compile_cli.main(["smollm2-135m", "-o", str(tmp_path / "out"), "--quiet"])
    else:
        code = main_cli.main(command)
    assert code == 2
    assert "SHARPI_HOME" in _one_error_line(capsys.readouterr().err)
    assert notes.read_text() == "mine"


def test_a_gguf_whose_vocabulary_and_embeddings_disagree_is_refused(tmp_path, capsys):
    import gguf
    path = write_tiny_llama(tmp_path / "clean.gguf")
    reader = gguf.GGUFReader(str(path))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    rows = np.array(embd.data, dtype=np.float32).reshape(257, -1)
    bad = write_tiny_llama(tmp_path / "bad.gguf", override_raw={
        "token_embd.weight": (np.concatenate([rows, rows[:43]]), gguf.GGMLQuantizationType.F32)})
    assert compile_cli.main([str(bad), "-o", str(tmp_path / "o"), "--quiet"]) == 2
    assert "has 257 tokens in its vocabulary but 300 rows of embeddings" in _one_error_line(capsys.readouterr().err)


# -- pinning an artifact ---------------------------------------------------------------------------------------------
def test_a_pinned_artifact_is_verified_whole_before_it_loads(tiny_artifact, tmp_path, capsys):
    import json
    import shutil

    from sharpi.common.manifest import content_digest
    pin = sharpi.artifact_sha256(tiny_artifact)
    assert sharpi.load(tiny_artifact, expect_sha256=pin.upper()).score([1, 2]).shape == (2, 257)
    damaged = Path(shutil.copytree(tiny_artifact, tmp_path / "damaged"))
    with open(damaged / "weights.bin", "r+b") as f:               # the manifest is the pinned one, a file is not
        f.seek(100)
        f.write(b"\xff\xff")
    assert sharpi.load(damaged, verify=False).score([1, 2]).shape == (2, 257)      # unverified, unpinned: loads
    with pytest.raises(sharpi.ArtifactError, match="weights.bin does not match the hash"):
        sharpi.load(damaged, verify=False, expect_sha256=pin)                     # pinned: hashed whatever verify says
    edited = Path(shutil.copytree(tiny_artifact, tmp_path / "edited"))
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["prefill_chunk"] = 64
    manifest["digest"] = content_digest(manifest)
    (edited / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sharpi.ArtifactError, match="not the pinned"):
        sharpi.load(edited, expect_sha256=pin)
    assert main_cli.main(["run", str(edited), "-p", "hi", "-n", "1", "--expect-sha256", pin]) == 2
    assert "not the artifact you pinned" in _one_error_line(capsys.readouterr().err)


def test_sharpi_compile_prints_the_value_to_pin(fake_build, tiny_gguf, tmp_path, capsys):
    assert compile_cli.main([str(tiny_gguf), "-o", str(tmp_path / "a"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"manifest sha256 {sharpi.artifact_sha256(tmp_path / 'a')}" in err


def test_evict_after_more_tokens_is_refused(tiny_artifact):
    """The kept scores cover the scored prompt only: evicting after a decode would select over positions the
    scores never saw."""
    model = sharpi.load(tiny_artifact)
    ids = list(range(1, 101))
    with model.session(snapkv_budget=0, snapkv_window=8, snapkv_recency=4) as s:
        s.prefill(ids, keep_scores=True)
        with s.fork() as f:
            assert f.evict(32, recency=4)                          # right after the prefill: fine
        s.decode(5)
        with pytest.raises(sharpi.ConfigError, match=r"scored \(100 tokens\).*fed 1 more since"):
            s.evict(32, recency=4)
