"""Decode graphs (`workers/runner/cuda_graphs.py`): buckets, persistent buffers, padding rows,
and the runner's replayed decode steps against its eager ones.

There is no GPU here: graphs are `RecordingGraph` (graph_double.py), which replays by running
the forward again and checks that it took the same ops and shapes and waited for nothing. The
real model runs on CPU through the padded, fixed-size path, with the C decode kernel and with
the Triton kernel (in its interpreter). The test marked `cuda` captures real CUDA graphs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from tests.workers.runner.graph_double import RecordingGraph
from tests.workers.runner.models.families import WINDOWED, build_family
from workers.config import EngineArgs, add_engine_arguments, engine_args_from
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledChunk, SchedulerOutput
from workers.llm_engine import LLMEngine
from workers.runner.cuda_graphs import DecodeGraphs, StepViews, capture_sizes
from workers.runner.model_runner import ModelRunner, RunnerConfig
from workers.runner.sampler import SampleResult

CPU = torch.device("cpu")
BS = 4  # block size of the bookkeeping tests
NULL = 99  # their null block


def echo(views: StepViews) -> torch.Tensor:
    """What each row of the buffers holds: id, position, slot, length, and the block of its
    position in its table."""
    last_block = views.block_tables.gather(1, (views.positions // BS).unsqueeze(1))
    return torch.stack([views.token_ids, views.positions, views.slots,
                        views.seq_lens.long(), last_block[:, 0].long()], dim=1).float()


def echo_graphs(sizes=(1, 2, 4, 8)) -> DecodeGraphs:
    graphs = DecodeGraphs(echo, sizes, max_blocks=6, block_size=BS, null_block=NULL,
                          device=CPU, new_graph=RecordingGraph)
    graphs.capture()
    return graphs


def test_capture_sizes_follow_vllm_up_to_max_num_seqs():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)  # a full batch has its own graph
    assert capture_sizes(300)[-5:] == (248, 256, 272, 288, 300)
    assert capture_sizes(1) == (1,)
    assert capture_sizes(16, [8, 2, 2, 32]) == (2, 8)  # as given, none past max_num_seqs


def test_each_batch_replays_the_smallest_bucket_that_holds_it():
    graphs = echo_graphs()
    assert [graphs.bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9)] == [
        None, 1, 2, 4, 4, 8, 8, None]
    for n in (3, 5, 1, 3):
        graphs.run([(7, 0, [1])] * n)
    assert graphs.replays == {4: 2, 8: 1, 1: 1}
    with pytest.raises(ValueError, match="no captured graph"):
        graphs.run([(7, 0, [1])] * 9)


def test_rows_are_copied_in_and_padding_rows_point_at_the_null_block():
    graphs = echo_graphs()
    rows = [(11, 0, [5]), (12, 6, [3, 8]), (13, 13, [2, 4, 6, 1]), (14, 3, [9])]
    out = graphs.run(rows)
    expected = [[11, 0, 20, 1, 5], [12, 6, 34, 7, 8], [13, 13, 5, 14, 1], [14, 3, 39, 4, 9]]
    assert out.tolist() == expected
    out = graphs.run(rows[:3])  # the same bucket: the fourth row is padding now
    assert out.tolist() == expected[:3]
    pad = graphs.buffers.views(4)
    assert (pad.token_ids[3].item(), pad.positions[3].item(), pad.seq_lens[3].item()) == (0, 0, 1)
    assert pad.slots[3].item() == NULL * BS  # the null block's first position
    assert pad.block_tables[3, 0].item() == NULL


def test_buffers_and_outputs_are_reused_across_steps():
    graphs = echo_graphs()
    buffers = graphs.buffers
    tensors = [buffers.dev_long, buffers.dev_int, buffers.host_long, buffers.host_int]
    addresses = [t.data_ptr() for t in tensors]
    first = graphs.run([(1, 2, [3])] * 3)
    first_address = first.data_ptr()
    for n in (5, 2, 8, 3):
        out = graphs.run([(n, n % 8, [n, n])] * n)
    assert [t.data_ptr() for t in tensors] == addresses
    assert out.data_ptr() == first_address  # the bucket's captured output, rewritten
    assert graphs.replays == {4: 2, 8: 2, 2: 1}  # five replays of graphs captured once


# ---- the real model, on CPU ---------------------------------------------------------------

def load_runner(folder: Path, **overrides) -> ModelRunner:
    config = dict(model_path=folder, device=CPU, dtype=torch.float32, block_size=16,
                  kv_cache_memory=4 << 20, kv_cache_fraction=None, max_model_len=256,
                  attention_backend="cpu", linear_backend="torch", elementwise="torch")
    config.update(overrides)
    return ModelRunner.load(RunnerConfig(**config), AutoConfig.from_pretrained(folder), [0])


def with_graphs(runner: ModelRunner, sizes=(1, 2, 4, 8)) -> ModelRunner:
    assert runner.enable_decode_graphs(sizes, new_graph=RecordingGraph)
    return runner


def chunk(seq_id: int, tokens: list[int], start: int, table: list[int],
          prompt: list[int]) -> ScheduledChunk:
    return ScheduledChunk(
        seq_id=seq_id, token_ids=tokens, start_pos=start, block_table=table, num_samples=1,
        sampling_params=SamplingParams(temperature=0, logprobs=20), prompt_token_ids=prompt,
        output_token_ids=[], num_output_tokens=0, seed=None)


def assert_same_logprobs(ours: SampleResult, theirs: SampleResult) -> None:
    """The same token, and the same top-20 logprobs up to float32 noise (a GEMM of 4 rows
    may round differently from one of 3)."""
    assert ours.token_ids == theirs.token_ids
    assert ours.logprobs is not None and theirs.logprobs is not None
    a, b = ours.logprobs[0].top, theirs.logprobs[0].top
    assert [t for t, _ in a] == [t for t, _ in b]
    torch.testing.assert_close(torch.tensor([v for _, v in a]), torch.tensor([v for _, v in b]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_padded_rows_leave_the_real_rows_and_their_kv_alone(tiny_llama_path, backend):
    """Three decode rows replay the 4-row graph: the real rows' logprobs and every block
    but the null one match the eager runner's; the padding row wrote only the null block."""
    eager = load_runner(tiny_llama_path, attention_backend=backend)
    graphed = with_graphs(load_runner(tiny_llama_path, attention_backend=backend), (4,))
    prompts = [[5, 900, 31, 7, 64], list(range(300, 317)), list(range(1000, 1030))]
    tables = [[0], [1, 2], [3, 4]]
    prefill = SchedulerOutput([chunk(i, p, 0, t, p) for i, (p, t) in
                               enumerate(zip(prompts, tables, strict=True))])
    firsts = [eager.execute(prefill), graphed.execute(prefill)]
    assert firsts[0][0].token_ids == firsts[1][0].token_ids
    step = SchedulerOutput([chunk(i, firsts[0][i].token_ids, len(p), t, p) for i, (p, t)
                            in enumerate(zip(prompts, tables, strict=True))])
    ours, theirs = graphed.execute(step), eager.execute(step)
    assert graphed.graphs is not None and graphed.graphs.replays == {4: 1}
    for seq_id in range(3):
        assert_same_logprobs(ours[seq_id], theirs[seq_id])
    null = graphed.num_blocks
    for (k_ours, v_ours), (k_theirs, v_theirs) in zip(graphed.kv_caches, eager.kv_caches,
                                                      strict=True):
        torch.testing.assert_close(k_ours[:null], k_theirs[:null], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_ours[:null], v_theirs[:null], rtol=1e-5, atol=1e-5)
        assert k_ours[null, :, 0].abs().sum() > 0  # the padding row's K went there
        assert not k_ours[null, :, 1:].any()  # and nowhere else


def generate(engine: LLMEngine, prompts: list[list[int]],
             params: list[SamplingParams]) -> list[list[int]]:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done: dict[str, list[int]] = {}
    while len(done) < len(prompts):
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def engine_on(runner: ModelRunner, tokenizer) -> LLMEngine:
    return LLMEngine(EngineArgs(kv_cache_memory=4 << 20), tokenizer, runner,
                     runner.max_model_len, runner.num_blocks, [tokenizer.eos_token_id],
                     len(tokenizer))


def test_engine_decodes_through_graphs_to_the_eager_tokens(tiny_llama_path, tokenizer):
    """Six requests that finish at different steps: decode batches of 6, 5, 4, 3, 2 and 1
    rows replay buckets 8, 4, 2 and 1; prompt steps run eagerly; tokens equal the eager
    engine's, with penalties and logprobs applied outside the graph."""
    prompts = [list(range(100 + 7 * i, 110 + 9 * i)) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in
              (2, 3, 5, 8, 10, 11)]
    params[1] = SamplingParams(temperature=0, max_tokens=3, repetition_penalty=1.3,
                               ignore_eos=True)
    params[4] = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    runner = with_graphs(load_runner(tiny_llama_path, attention_backend="cpu",
                                     linear_backend="auto", elementwise="auto"))
    ours = generate(engine_on(runner, tokenizer), prompts, params)
    theirs = generate(engine_on(load_runner(tiny_llama_path, linear_backend="auto",
                                            elementwise="auto"), tokenizer), prompts, params)
    assert ours == theirs
    assert [len(t) for t in ours] == [2, 3, 5, 8, 10, 11]
    assert runner.graphs is not None and set(runner.graphs.replays) == {1, 2, 4, 8}
    assert sum(runner.graphs.replays.values()) == 10  # every step after the prompts'


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "mistral"])
def test_captured_forward_waits_for_nothing_in_any_family(tmp_path, tokenizer, family):
    """The decode path as CUDA runs it (torch projections and element-wise ops, the in-place
    decode kernel) has no host sync and no step-dependent shape: capture and a replay with
    real rows under `RecordingGraph`'s checks, and the eager runner's tokens and logprobs;
    windows (Mistral's and Gemma 2's bind here), soft-capping, Gemma's embedding scale and
    Qwen3's q/k norms included; an int8 pool for Mistral."""
    build_family(tmp_path, tokenizer, family, **WINDOWED.get(family, {}))
    kv = "int8" if family == "mistral" else "auto"
    runner = with_graphs(load_runner(tmp_path, kv_cache_dtype=kv), (2,))
    eager = load_runner(tmp_path, kv_cache_dtype=kv)
    prompts = [list(range(200, 240)), list(range(500, 503))]
    tables = [[0, 1, 2], [3]]
    prefill = SchedulerOutput([chunk(i, p, 0, t, p) for i, (p, t) in
                               enumerate(zip(prompts, tables, strict=True))])
    first = runner.execute(prefill)
    assert eager.execute(prefill)[0].token_ids == first[0].token_ids
    step = SchedulerOutput([chunk(i, first[i].token_ids, len(p), t, p) for i, (p, t)
                            in enumerate(zip(prompts, tables, strict=True))])
    ours, theirs = runner.execute(step), eager.execute(step)
    assert runner.graphs is not None and runner.graphs.replays == {2: 1}
    for seq_id in (0, 1):
        assert_same_logprobs(ours[seq_id], theirs[seq_id])


def test_runners_that_cannot_be_captured_stay_eager(tiny_llama_path, tmp_path, tokenizer):
    runner = load_runner(tiny_llama_path, attention_backend="torch")
    blocks = runner.num_blocks
    assert "in-place kernel" in runner.decode_graph_refusal()
    assert not runner.enable_decode_graphs((1, 2), new_graph=RecordingGraph)
    assert runner.graphs is None and runner.num_blocks == blocks  # no null block taken
    build_family(tmp_path, tokenizer, "qwen3_moe")
    assert "bincount" in load_runner(tmp_path).decode_graph_refusal()


class RefusedGraph(RecordingGraph):
    """A device that refuses the capture (a kernel that waits for the host, say)."""

    def capture(self, forward):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_refused_capture_leaves_the_runner_eager(tiny_llama_path, caplog):
    runner = load_runner(tiny_llama_path)
    blocks, length = runner.num_blocks, runner.max_model_len
    assert not runner.enable_decode_graphs((1, 2), new_graph=RefusedGraph)
    assert runner.graphs is None and (runner.num_blocks, runner.max_model_len) == (blocks,
                                                                                   length)
    assert "run eagerly" in caplog.text and "stream is capturing" in caplog.text


def test_a_cpu_engine_ignores_cuda_graphs(tiny_llama_path):
    engine = LLMEngine.from_args(model=str(tiny_llama_path), kv_cache_memory=4 << 20,
                                 cuda_graphs=True)
    assert EngineArgs().cuda_graphs  # on by default, where the device is CUDA
    assert engine.runner.graphs is None


def test_the_setting_flows_from_engine_args_to_the_runner(tiny_llama_path, monkeypatch):
    seen: list[RunnerConfig] = []
    load = ModelRunner.load.__func__

    def recording_load(cls, config, *args):
        seen.append(config)
        return load(cls, config, *args)

    monkeypatch.setattr(ModelRunner, "load", classmethod(recording_load))
    common = dict(model=str(tiny_llama_path), kv_cache_memory=4 << 20)
    LLMEngine.from_args(**common, max_num_seqs=20)
    LLMEngine.from_args(**common, cuda_graph_sizes=[4, 1])
    LLMEngine.from_args(**common, cuda_graphs=False)
    assert [c.decode_graph_sizes for c in seen] == [(1, 2, 4, 8, 16, 20), (1, 4), ()]

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = engine_args_from(parser.parse_args(["--no-cuda-graphs",
                                               "--cuda-graph-sizes", "[1, 2]"]))
    assert (args.cuda_graphs, args.cuda_graph_sizes) == (False, [1, 2])
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED__CUDA_GRAPHS", "false")
    from gateway.settings import Settings

    assert Settings().embedded.cuda_graphs is False
    with pytest.raises(ValueError, match="positive"):
        EngineArgs(cuda_graph_sizes=[0, 4])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_gives_the_eager_greedy_tokens(tiny_llama_path, tokenizer):
    """On a GPU: real CUDA graphs captured at load, float32, against the same engine with
    `cuda_graphs` off; batches shrink through several buckets."""
    prompts = [list(range(100 + 7 * i, 110 + 9 * i)) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in
              (2, 3, 5, 8, 10, 11)]
    outputs = {}
    for graphs in (True, False):
        engine = LLMEngine.from_args(model=str(tiny_llama_path), device="cuda",
                                     dtype="float32", kv_cache_memory=64 << 20,
                                     cuda_graphs=graphs, cuda_graph_sizes=[1, 2, 4, 8])
        outputs[graphs] = generate(engine, prompts, params)
        if graphs:
            assert engine.runner.graphs is not None
            assert set(engine.runner.graphs.replays) == {1, 2, 4, 8}
        else:
            assert engine.runner.graphs is None
    assert outputs[True] == outputs[False]
