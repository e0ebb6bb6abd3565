"""The broadcast transport through tandem's HTTP routes and HttpClient: this process is the
trainer (rank 0), the engine serves HTTP; the group forms, buckets arrive as flattened broadcasts,
the group is destroyed and a re-init that no trainer answers fails within its timeout.
Oracle: an engine started on the pushed checkpoint."""

from __future__ import annotations

import threading
import time

from engine.models.parallel_state import free_port
from tests.engine_client.test_http_client import _serving

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [300, 12, 800, 9, 77]]


def _greedy(client_or_engine) -> list[list[int]]:
    return [o["output_ids"] for o in client_or_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_push_over_http_routes_to_a_served_engine():
    from safetensors.torch import load_file

    from engine import Engine
    from engine.models.loader import safetensors_files
    from engine.testing.tiny_model import tiny_model_path
    from engine_client.client import HttpClient
    from trainer_bridge.sync import push_to_engines
    from weight_sync.weight_group import WeightGroup

    model_a, model_b = str(tiny_model_path()), str(tiny_model_path(seed=1))
    oracle = Engine(model_path=model_b, dtype="float32", device="cpu")
    engine = Engine(model_path=model_a, dtype="float32", device="cpu")
    try:
        expected = _greedy(oracle)
        with _serving(engine) as url:
            client = HttpClient(url)
            assert _greedy(client) != expected
            port, joined = free_port(), []
            joining = threading.Thread(target=lambda: joined.append(client.init_weights_update_group(
                "127.0.0.1", port, 1, 2, "http-wg", backend="gloo", timeout_s=60)))
            joining.start()
            group = WeightGroup("127.0.0.1", port, 0, 2, "http-wg", backend="gloo", timeout_s=60)
            joining.join()
            assert joined[0][0], joined
            named = [kv for path in safetensors_files(model_b) for kv in load_file(path).items()]
            push_to_engines([client], [named], "http-1", transport="distributed", bucket_bytes=128 << 10,
                            group=group, group_name="http-wg")
            assert _greedy(client) == expected and engine.get_weight_version() == "http-1"
            assert client.destroy_weights_update_group("http-wg")[0]
            group.destroy()
            start = time.monotonic()  # the same name again, no trainer listening: refused in time
            ok, message = client.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "http-wg",
                                                           backend="gloo", timeout_s=2)
            assert not ok and "Failed to init weight update group 'http-wg'" in message
            assert time.monotonic() - start < 15
            for thread in threading.enumerate():  # torch's store client retries past its timeout; a thread
                if thread.name == "tandem-rendezvous-http-wg":  # still inside C++ at exit aborts the process
                    thread.join(30)
            assert _greedy(client) == expected  # still serving
            client.close()
    finally:
        engine.shutdown()
        oracle.shutdown()
