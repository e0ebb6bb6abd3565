"""Generation clients for the harness and replay: an in-process Engine, or a server over HTTP.

Both send a whole batch at once (one `Engine.generate` call, or one SGLang batch POST
/generate with lists), so the requests of a batch reach the scheduler together. The in-process
client imports nothing of the HTTP stack; the HTTP client imports httpx only when built.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional, Protocol

# Without a vocab size from the server, prompts use ids below this (valid for any real model).
FALLBACK_VOCAB = 1000
FLUSH_RETRIES = 100


class GenerationClient(Protocol):
    def generate(self, input_ids: list[list[int]], sampling_params: list[dict], return_logprob: bool = True,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 logprob_distribution: Optional[str] = None) -> list[dict]: ...

    def flush_cache(self) -> bool: ...

    def model_info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def flush_cache(client: GenerationClient) -> None:
    """Flush, waiting for requests that are still being released to finish."""
    for _ in range(FLUSH_RETRIES):
        if client.flush_cache():
            return
        time.sleep(0.05)
    raise RuntimeError("could not flush the cache: requests are still running")


class EngineClient:
    """Over an in-process Engine (built from kwargs, or given; a given one is not shut down)."""

    def __init__(self, engine: Any = None, **engine_kwargs: Any) -> None:
        if engine is None:
            from engine import Engine

            engine = Engine(**engine_kwargs)
            self._owned = True
        else:
            self._owned = False
        self.engine = engine

    def generate(self, input_ids, sampling_params, return_logprob=True, logprob_start_len=-1,
                 top_logprobs_num=0, logprob_distribution=None) -> list[dict]:
        return self.engine.generate(input_ids=input_ids, sampling_params=sampling_params,
                                    return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                    top_logprobs_num=top_logprobs_num,
                                    logprob_distribution=logprob_distribution)

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def model_info(self) -> dict[str, Any]:
        eng = self.engine
        return {"model_path": eng.server_args.model_path, "weight_version": eng.get_weight_version(),
                "vocab_size": eng.info.vocab_size,
                "deterministic": eng.server_args.enable_deterministic_inference,
                "chunked_prefill_size": eng.info.chunked_prefill_size}

    def close(self) -> None:
        if self._owned:
            self.engine.shutdown()


class HttpClient:
    """Over a running server's SGLang routes. `http` may be any httpx.Client (e.g. FastAPI's
    TestClient, or one with a mock transport); otherwise one is made for `url`."""

    def __init__(self, url: str = "http://127.0.0.1:30000", http: Any = None,
                 api_key: Optional[str] = None, timeout: float = 600.0) -> None:
        if http is None:
            import httpx

            http = httpx.Client(base_url=url, timeout=timeout)
            self._owned = True
        else:
            self._owned = False
        self.http = http
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def generate(self, input_ids, sampling_params, return_logprob=True, logprob_start_len=-1,
                 top_logprobs_num=0, logprob_distribution=None) -> list[dict]:
        body = {"input_ids": input_ids, "sampling_params": sampling_params,
                "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                "top_logprobs_num": top_logprobs_num, "logprob_distribution": logprob_distribution}
        resp = self.http.post("/generate", json=body, headers=self.headers)
        if resp.status_code != 200:
            raise ValueError(f"POST /generate -> {resp.status_code}: {_message(resp)}")
        out = resp.json()
        return out if isinstance(out, list) else [out]

    def flush_cache(self) -> bool:
        return self.http.post("/flush_cache", headers=self.headers).status_code == 200

    def model_info(self) -> dict[str, Any]:
        resp = self.http.get("/model_info", headers=self.headers)
        if resp.status_code != 200:
            raise ValueError(f"GET /model_info -> {resp.status_code}: {_message(resp)}")
        info = dict(resp.json())
        info.setdefault("weight_version", "default")
        if not info.get("vocab_size"):
            info["vocab_size"] = _vocab_from_config(info.get("model_path")) or FALLBACK_VOCAB
        return info

    def close(self) -> None:
        if self._owned:
            self.http.close()


def _message(resp: Any) -> str:
    try:
        return str(resp.json().get("message", resp.text))
    except (ValueError, AttributeError):
        return resp.text


def _vocab_from_config(model_path: Optional[str]) -> Optional[int]:
    """The vocab size from <model_path>/config.json, when the server's path is readable here."""
    if not model_path:
        return None
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
