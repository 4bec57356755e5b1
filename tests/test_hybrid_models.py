"""Hybrid linear-attention models (qwen35, qwen35moe, qwen3next) compiled for the CPU, on the tiny random GGUFs of
tests/data/hybrid_golden.json: `--matmuls float` against the numpy reference and llama.cpp's logits (teacher-forced,
prefill then decode through the paged cache and the state pool, forks, decode batches), the default int8 artifact
within the dense tiny models' int8 bounds, SnapKV shrinking the attention layers only.

Tolerances as tests/test_moe_models.py: the float path differs from the reference in summation order only (~1e-5 of
the logits' scale), 1e-4 is ~10x that, and tests/test_hybrid_reference.py shows every part of a hybrid (the q gate,
the conv, the decay, the head mapping) moving the logits by more than 1e-2."""
import json
from pathlib import Path

import numpy as np
import pytest

import sharpi
from sharpi.common.errors import ConfigError
from sharpi.common.manifest import Manifest
from sharpi.runtime.session import decode_batch
from sharpi.runtime.state_pool import StatePoolExhaustedError
from sharpi.testing.reference import NumpyReference, log_softmax
from tiny_gguf import HYBRID_ARCHS, HYBRID_GOLDEN, write_golden_hybrid, write_tiny_hybrid

GOLDEN = json.loads(HYBRID_GOLDEN.read_text())
IDS = GOLDEN["ids"]
RTOL = 1e-4


def _err(got, expected) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def float_hybrid(request, tmp_path_factory):
    """(arch, GGUF path, the `--matmuls float` model, the reference's logits over IDS)."""
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    path = write_golden_hybrid(folder, arch)
    model = sharpi.load(sharpi.compile(str(path), target="llvm", output=folder / "art", matmuls="float"),
                        pool_sequences=3)
    return arch, path, model, NumpyReference(path).forward(IDS)


def test_teacher_forced_logits_equal_the_reference_and_llama_cpp(float_hybrid):
    arch, _, model, expected = float_hybrid
    got = model.score(IDS)
    assert _err(got, expected) < RTOL
    with np.load(Path(__file__).parent / "data" / "hybrid_golden.npz") as golden:
        assert _err(got, golden[arch]) < RTOL


def test_prefill_then_decode_equal_one_prefill(float_hybrid):
    """prefill(30) then 10 decodes (the state carried through the pool, the sequential kernels' one-token form)
    equal the reference and prefill(40)'s last logits."""
    _, _, model, expected = float_hybrid
    with model.session() as s:
        assert _err(s.prefill(IDS[:30]), expected[29]) < RTOL
        for i in range(30, 40):
            last = s.decode(IDS[i])
            assert _err(last, expected[i]) < RTOL, i
    with model.session() as whole:
        assert _err(whole.prefill(IDS[:40]), last) < RTOL


def test_a_fork_equals_its_parent(float_hybrid):
    """A fork copies the recurrent state: both go on alike, and neither disturbs the other."""
    _, _, model, expected = float_hybrid
    with model.session() as parent:
        parent.prefill(IDS[:24])
        with parent.fork() as child:
            np.testing.assert_array_equal(child.decode(IDS[24]), parent.decode(IDS[24]))
            child.decode(IDS[0])                                 # the child leaves the prompt
            assert _err(parent.decode(IDS[25]), expected[25]) < RTOL


def test_decode_batch_equals_the_reference(float_hybrid):
    """Two sequences of different lengths decoded in one decode_batch call, each token with its own state slot."""
    _, _, model, expected = float_hybrid
    with model.session() as a, model.session() as b:
        a.prefill(IDS[:20])
        b.prefill(IDS[:25])
        rows = decode_batch([a, b], [IDS[20], IDS[25]])
    assert _err(rows[0], expected[20]) < RTOL and _err(rows[1], expected[25]) < RTOL


def test_memory_counts_the_state_and_slots_run_out_clearly(float_hybrid):
    _, _, model, _ = float_hybrid
    cfg = model.config
    with model.session() as s:
        s.prefill(IDS[:20])
        pages = sum(-(-n // 16) for n in s.kv_length) * model.engine.pool.page_bytes
        assert len(s.kv_length) == cfg.kv_layers                   # the attention layers alone hold pages
        assert s.kv_bytes == pages + model.engine.states.slot_bytes
        sessions = [model.session() for _ in range(model.engine.states.slots - 1)]
        for other in sessions:
            other.prefill(IDS[:4])
        with pytest.raises(StatePoolExhaustedError, match="recurrent-state slots"):
            model.session().prefill(IDS[:4])
        for other in sessions:
            other.close()


def test_speculative_decoding_is_refused(float_hybrid):
    """A recurrent state cannot roll back rejected drafts: asking for speculation is one clear sentence."""
    _, _, model, _ = float_hybrid
    with pytest.raises(ConfigError, match="recurrent state"):
        model.generate(IDS[:10], max_tokens=4, speculative="lookup")


def test_snapkv_shrinks_the_attention_layers_only(float_hybrid):
    """SnapKV on a 40-token prompt, budget 16: every attention layer keeps 16 slots, the logical length stays,
    and the next token's logits equal the reference's evicted path (the kept slots per attention layer, every
    DeltaNet state whole)."""
    _, path, model, expected = float_hybrid
    ref = NumpyReference(path)
    with model.session(snapkv_budget=16, snapkv_recency=4, snapkv_window=4) as s:
        s.prefill(IDS[:40])
        assert s.kv_length == [16] * model.config.kv_layers and s.logical_length == 40
        got = s.decode(IDS[40])
        kept = [k[:, :-1] for k in s.kept_positions]
    assert _err(got, ref.decode_after_compaction(IDS[:40], kept, IDS[40])) < RTOL
    assert _err(got, expected[40]) > 1e-3                         # the eviction did change the attention


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_int8_artifact_is_near_the_reference(arch, tmp_path):
    """The default CPU artifact of a Q8_0 hybrid (int8 matmuls where the CPU has AVX2) within the conformance
    tolerance for int8 matmuls of the reference's log-probs, its top-1 never off by more than a near-tie.

    DeltaNet heads of 32 here (real models' are 128): with 16-wide heads a token's first outputs are
    S^T q = beta v (k . q), whose per-head RMS norm keeps only the sign of a small k . q, and int8 activations flip
    that sign often enough to move the tiny models' log-probs by 2-3 (the numpy reference with q8-rounded
    activations moves as much; measured 2026-12-07)."""
    from sharpi.testing.conformance import tolerance_for
    model_info = GOLDEN["models"][arch]
    path = write_tiny_hybrid(tmp_path / f"{arch}.gguf", arch, seed=model_info["seed"], interval=model_info["interval"],
                             router_scale=model_info["router_scale"], matrix_type="Q8_0", shared_ffn=64,
                             ssm_state=32)
    model = sharpi.load(sharpi.compile(str(path), output=tmp_path / "art"))
    if model.manifest.target["matmuls"] != "int8":
        pytest.skip("this CPU has no AVX2: the default matmuls are float32 (tested above)")
    want = log_softmax(NumpyReference(path).forward(IDS))[29:40]
    with model.session() as s:
        got = log_softmax(np.stack([s.prefill(IDS[:30])] + [s.decode(IDS[i]) for i in range(30, 40)]))
    tol = tolerance_for(model.manifest)
    assert np.abs(got - want).max() <= tol.logprob_atol
    assert np.abs(got - want).max() > 1e-5                            # the int8 kernels ran
    assert (want.max(-1) - want[np.arange(len(want)), got.argmax(-1)] <= tol.near_tie).all()


CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def qwen35_artifact(tmp_path_factory):
    """The golden tiny qwen35 with a chat template, `--matmuls float`: the server's tests."""
    folder = tmp_path_factory.mktemp("serve")
    info = GOLDEN["models"]["qwen35"]
    path = write_tiny_hybrid(folder / "chat.gguf", "qwen35", seed=info["seed"], interval=info["interval"],
                             chat_template=CHAT_TEMPLATE)
    return sharpi.compile(str(path), target="llvm", output=folder / "art", matmuls="float")


def test_the_server_answers_concurrent_requests_as_solo_ones(qwen35_artifact):
    """8 concurrent greedy requests through the unmodified openai client each equal their solo output (decode
    batches of several sequences, each with its own state slot, beside the prefix cache's snapshots)."""
    import openai
    from concurrent.futures import ThreadPoolExecutor
    from openai_server import NAME, PROMPTS, Server, assert_same_greedy, complete

    server = Server(sharpi.load(qwen35_artifact, pool_tokens=2048, pool_sequences=8, state_snapshots=8), parallel=8)
    try:
        ask = lambda p: complete(server.client, p, 64, extra_body={"ignore_eos": True})    # noqa: E731
        solo = [ask(p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(ask, PROMPTS))
        for p, a, b in zip(PROMPTS, solo, together):
            assert_same_greedy(a, b, p)
        assert server.metric("sharpi_decode_batch_size_bucket", '{le="1.0"}') < server.metric(
            "sharpi_decode_batch_size_count"), "no decode step ran several sequences at once"
        server.wait_idle()
        assert server.engine.engine.states.used_count == len(server.engine.prefix_cache._snapshots)
        with pytest.raises(openai.BadRequestError, match="recurrent state"):
            server.client.completions.create(model=NAME, prompt="Hi", max_tokens=4,
                                             extra_body={"speculative": "lookup"})
    finally:
        server.close()


def test_preemption_recomputes_the_state(qwen35_artifact):
    """64 slots a layer for four sequences growing to ~57 tokens, submitted at once: sequences are preempted,
    recomputed from their tokens (the state from empty) and each output is its solo one, token for token."""
    import threading
    from sharpi.serve.engine import ServeEngine, ServeSettings, generate
    from sharpi.serve.request import GenerationRequest

    model = sharpi.load(qwen35_artifact, pool_tokens=64, pool_sequences=4)
    prompts = [model.tokenize(p) for p in ("The sky is", "Once upon a time,", "def f(x):", "Colours:")]
    engine = ServeEngine(model, ServeSettings(parallel=4, prefix_cache=False)).start()
    try:
        request = lambda ids: GenerationRequest(ids, max_tokens=48, ignore_eos=True)     # noqa: E731
        solo = [[t for e in generate(engine, request(ids))[2] for t in e.token_ids] for ids in prompts]
        together, done = [[] for _ in prompts], threading.Semaphore(0)

        def collect(i):
            def on_event(event):
                together[i].extend(event.token_ids)
                if event.kind == "finish":
                    done.release()
            return on_event

        for i, ids in enumerate(prompts):         # within microseconds: the four run side by side
            engine.submit(request(ids), collect(i))
        for _ in prompts:
            assert done.acquire(timeout=120)
        assert together == solo
        assert engine.metrics.preemptions._value.get() > 0
        assert model.engine.states.used_count == 0
    finally:
        engine.shutdown()


def test_a_chats_next_turn_goes_on_from_the_snapshot(qwen35_artifact):
    """The prefix cache keeps a hybrid prompt's pages and its recurrent state at the prompt's last full page: the
    next turn of the chat ([the first turn's prompt, its answer, a question]) reports those tokens as cached,
    computes only the rest, and answers as the same request on a server without a cache."""
    from openai_server import NAME, Server

    messages = [{"role": "user", "content": "Tell me a story about a dragon and a knight in a castle. " * 3}]
    cached, uncached = (Server(sharpi.load(qwen35_artifact, pool_tokens=2048, pool_sequences=2, state_snapshots=2),
                               parallel=2, prefix_cache=flag) for flag in (True, False))
    try:
        def turn(server, history):
            reply = server.client.chat.completions.create(model=NAME, messages=history, max_tokens=12,
                                                          temperature=0)
            return reply, history + [{"role": "assistant", "content": reply.choices[0].message.content}]

        first, history = turn(cached, messages)
        prompt_tokens = first.usage.prompt_tokens
        fed = cached.metric("sharpi_prefill_tokens_total", '{kind="prompt"}')
        history += [{"role": "user", "content": "And then?"}]
        second, _ = turn(cached, history)
        hit = second.usage.prompt_tokens_details.cached_tokens
        assert hit >= prompt_tokens - 16 - 1 and hit % 16 == 0           # the first prompt's last full page
        assert cached.metric("sharpi_prefill_tokens_total", '{kind="prompt"}') - fed == \
            second.usage.prompt_tokens - hit                               # only the rest was computed
        alone, _ = turn(uncached, history)
        assert second.choices[0].message.content == alone.choices[0].message.content
        assert alone.usage.prompt_tokens_details.cached_tokens == 0
        assert cached.engine.pool_summary()["state_bytes"] > 0            # the snapshot is held
    finally:
        cached.close()
        uncached.close()


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_vulkan_equals_the_reference(arch, tmp_path):
    """The GPU kernels (kernels/gpu/delta_net.py: an invocation per state column) on Vulkan (lavapipe in CI): teacher-
    forced, prefill then decode, a fork and a decode batch equal the reference."""
    from vulkan_device import on_vulkan
    path = write_golden_hybrid(tmp_path, arch)
    artifact = sharpi.compile(str(path), target="vulkan", output=tmp_path / "vk")
    model = on_vulkan(lambda: sharpi.load(artifact))
    expected = NumpyReference(path).forward(IDS)
    assert _err(model.score(IDS), expected) < RTOL
    with model.session() as a, model.session() as b:
        assert _err(a.prefill(IDS[:30]), expected[29]) < RTOL
        b.prefill(IDS[:25])
        for i in range(30, 34):
            assert _err(a.decode(IDS[i]), expected[i]) < RTOL
        with a.fork() as child:
            rows = decode_batch([b, child], [IDS[25], IDS[34]])
    assert _err(rows[0], expected[25]) < RTOL and _err(rows[1], expected[34]) < RTOL


def test_cuda_builds(tmp_path):
    """The cuda target compiles a hybrid with nvcc (no GPU needed): its library holds the DeltaNet kernels."""
    import os
    import shutil
    from sharpi.codegen.targets.cuda import fatbin_entries
    if shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc") and not os.environ.get("CI"):
        pytest.skip("the cuda target compiles with nvcc, which this machine lacks (CI installs it)")
    artifact = sharpi.compile(str(write_golden_hybrid(tmp_path, "qwen3next")), target="cuda", output=tmp_path / "cu")
    library = (artifact / "model.so").read_bytes()
    assert {kind for kind, _ in fatbin_entries(library)} == {"elf", "ptx"}
    for kernel in (b"gpu_delta_rule", b"gpu_delta_conv", b"gpu_state_copy"):
        assert kernel in library
    assert "state_copy" in Manifest.read(artifact).functions


def test_the_conformance_suite_and_onnx_export(float_hybrid, tmp_path):
    """`sharpi check`'s suite passes on a hybrid (kv_bytes counting the state), and the ONNX export says in one
    sentence that it has no translation for DeltaNet layers."""
    from sharpi.common.errors import UnsupportedArchitectureError
    from sharpi.testing.conformance import Suite
    _, path, model, _ = float_hybrid
    suite = Suite(model.path, reference="numpy", gguf=path)
    try:
        results = suite.run_all()
    finally:
        suite.close()
    assert all(r.status == "PASS" for r in results), [(r.name, r.status, r.detail) for r in results]
    with pytest.raises(UnsupportedArchitectureError, match="Gated DeltaNet"):
        sharpi.compile(str(path), output=tmp_path / "onnx", emit="onnx")


def test_fixed_decode_inputs_carry_the_slots(float_hybrid):
    """--cuda-graph replays decode from fixed input buffers (TVMBackend._decode_inputs); a hybrid's state slots
    must be among them, or a replay reads the slot of the step it was captured at. Forced on the CPU backend: two
    sequences decoded in turn through the fixed buffers each equal the reference."""
    _, _, model, expected = float_hybrid
    backend = model.engine.backend
    backend._fixed_decode_inputs, backend._decode_buffers = True, None
    try:
        with model.session() as a, model.session() as b:
            a.prefill(IDS[:20])
            b.prefill(IDS[:25])
            assert _err(a.decode(IDS[20]), expected[20]) < RTOL
            assert _err(b.decode(IDS[25]), expected[25]) < RTOL
            assert _err(a.decode(IDS[21]), expected[21]) < RTOL
        assert len(backend._decode_buffers) == 5                      # ids, positions, pages, lengths, slots
    finally:
        backend._fixed_decode_inputs, backend._decode_buffers = False, None
