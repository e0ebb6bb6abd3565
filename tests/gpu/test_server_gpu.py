"""The HTTP server on the GPU (overlap scheduling and CUDA graphs on): a client that leaves
mid-stream or mid-wait frees its KV with lookahead steps in flight; input_top_logprobs come from
the prompt pass (CUDA) and match HF transformers."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
httpx = pytest.importorskip("httpx")

LONG = {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served():
    import uvicorn

    from engine import Engine
    from engine.server.http import create_app
    from engine.testing.tiny_model import tiny_model_path

    path = str(tiny_model_path())
    eng = Engine(model_path=path, device="cuda", dtype="float32", cuda_graph_max_bs=32, max_total_tokens=65536)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(eng), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield eng, f"http://127.0.0.1:{sock.getsockname()[1]}", path
    server.should_exit = True
    thread.join(timeout=10)
    eng.shutdown()
    torch.cuda.empty_cache()


def wait_idle(eng, timeout: float = 5.0) -> float:
    start = time.monotonic()
    while True:
        stats = eng.get_stats()
        if stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, stats
        time.sleep(0.005)


def test_leaving_clients_free_kv_with_overlap(served):
    eng, url, _ = served
    for _ in range(3):
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/generate", json={"input_ids": [5, 6, 7], "sampling_params": LONG,
                                                         "stream": True}) as resp:
                lines = resp.iter_lines()
                for _ in range(5):
                    next(line for line in lines if line.startswith("data: "))
        assert wait_idle(eng) < 1.0
        with httpx.Client(base_url=url, timeout=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/generate", json={"input_ids": [[5, 6, 7]] * 8, "sampling_params": LONG})
        assert wait_idle(eng) < 1.0
    assert eng.flush_cache()
    eng.check_integrity()
    assert eng.get_stats().kv_tokens_used <= 1


def test_input_top_logprobs_on_gpu_match_hf(served):
    from transformers import AutoModelForCausalLM

    eng, url, path = served
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompt = [5, 17, 99, 3, 250, 8, 41]
    with torch.no_grad():
        expected = torch.topk(torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)[:-1], 4, -1)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 4}
    tops = httpx.post(f"{url}/generate", json=body, timeout=30).json()["meta_info"]["input_top_logprobs"]
    assert tops[0] is None and len(tops) == len(prompt)
    for pos in range(1, len(prompt)):
        assert [e[1] for e in tops[pos]] == expected.indices[pos - 1].tolist()
        assert [e[0] for e in tops[pos]] == pytest.approx(expected.values[pos - 1].tolist(), abs=1e-3)
