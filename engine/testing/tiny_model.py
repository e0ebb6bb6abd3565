"""Builds small HF-format Qwen3 checkpoints locally, for tests, demos and dummy-weight benchmarks.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a built-in corpus, and
the tiny preset's weights are drawn from a seeded generator. HF transformers loads the result,
so it serves as the numerical oracle. Real-shape presets write config + tokenizer only, for
`--load-format dummy`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Sequence

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB = 1024  # target incl. specials; the corpus supports this many merges
# Qwen2/3's pre-tokenizer split: contractions, letter runs, single digits, punctuation, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0,
               use_cache=True, use_sliding_window=False, sliding_window=None, rope_scaling=None)
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, max_position_embeddings=4096,
                 rope_theta=10000.0, tie_word_embeddings=True, torch_dtype="float32"),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                       tie_word_embeddings=True, torch_dtype="bfloat16"),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                     vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                     tie_word_embeddings=True, torch_dtype="bfloat16"),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                     tie_word_embeddings=False, torch_dtype="bfloat16"),
}
# Qwen3-MoE: the tiny shapes with 4 experts, top-2 ("-mixed": layer 1 dense, as mlp_only_layers
# allows) and Qwen3-30B-A3B's published config
_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=1,
            norm_topk_prob=True, router_aux_loss_coef=0.001, output_router_logits=False)
PRESETS.update({
    "tiny-moe": dict(PRESETS["tiny"], **_MOE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     mlp_only_layers=[]),
    "tiny-moe-mixed": dict(PRESETS["tiny"], **_MOE, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, mlp_only_layers=[1]),
    "qwen3-30b-a3b": dict(_MOE, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, mlp_only_layers=[], vocab_size=151936,
                          max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False,
                          torch_dtype="bfloat16"),
})
# 30B-A3B at 4 of its 48 layers: trainer (ZeRO states, ~16 B a parameter) and engine on one GPU
PRESETS["qwen3-30b-a3b-4l"] = dict(PRESETS["qwen3-30b-a3b"], num_hidden_layers=4)
# Weight init of the tiny preset, measured (see tests): a larger std than HF's 0.02 so random
# logits are peaked (median top-1 vs top-2 gap ~0.5, <0.1% of gaps under 1e-3) and greedy
# decoding does not lock onto one token; logits stay small (std ~2.4) so float32 logprobs
# of two implementations agree to ~1e-5. Embeddings are drawn apart from the layers because
# with tied weights a dominant embedding makes every step predict the current token again.
TINY_INIT_STD = 0.25
TINY_EMBED_STD = 0.3
TINY_NORM_JITTER = 0.1  # norm weights != 1 so a loader that drops them fails the HF oracle


def build_tiny_model(out_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> Path:
    """Write an HF-format Qwen3 checkpoint into out_dir and return its path."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}; got {preset!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    config = _model_config(preset, tokenizer.get_vocab_size(), ids)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(preset, ids))
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(config))
    if is_random_weight_preset(preset):
        _write_weights(out / "model.safetensors", config, seed)
    return out


def is_random_weight_preset(preset: str) -> bool:
    """The tiny presets ship seeded weights; the real-shape ones config + tokenizer only."""
    return preset.startswith("tiny")


def tiny_model_path(cache_dir: Optional[str | os.PathLike] = None, preset: str = "tiny",
                    seed: int = 0) -> Path:
    """Build once into <cache>/<preset>-<hash>, then reuse; safe against concurrent builders."""
    root = Path(cache_dir) if cache_dir is not None else _default_cache_root()
    key = hashlib.sha256(f"{preset}|{seed}|{_code_version()}".encode()).hexdigest()[:16]
    target = root / f"{preset}-{key}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=root))
    try:
        build_tiny_model(staging, preset=preset, seed=seed)
        os.replace(staging, target)  # atomic; fails if another process won the race
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _default_cache_root() -> Path:
    if os.environ.get("TANDEM_CACHE_DIR"):
        return Path(os.environ["TANDEM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem"


def _code_version() -> str:
    # The cache key follows this file's source, so an edit here rebuilds cached models.
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _train_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, min_frequency=1, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok


def _model_config(preset: str, tokenizer_vocab: int, ids: dict[str, int]) -> dict:
    shape = dict(PRESETS[preset])
    # Round up like real checkpoints do; ids past the tokenizer decode to nothing.
    shape.setdefault("vocab_size", int(math.ceil(tokenizer_vocab / 64) * 64))
    # Written in the v4 layout real hub checkpoints use (rope_theta, torch_dtype): every
    # transformers version reads it, and so must the engine's loader.
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        **_COMMON, **shape,
        "initializer_range": TINY_INIT_STD if is_random_weight_preset(preset) else 0.02,
        "max_window_layers": shape["num_hidden_layers"],
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }


def _generation_config(preset: str, ids: dict[str, int]) -> dict:
    cfg = {"bos_token_id": ids["<|endoftext|>"],
           "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
           "pad_token_id": ids["<|endoftext|>"]}
    if not is_random_weight_preset(preset):  # Qwen3's published sampling defaults; tiny stays greedy by default
        cfg.update(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    return cfg


def _tokenizer_config(config: dict) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,  # keep decode(encode(x)) == x
        "split_special_tokens": False, "add_prefix_space": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_weights(path: Path, config: dict, seed: int) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    arch = config["architectures"][0]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    hf_config = config_cls(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):  # HF gives names and shapes; our generator gives the values
        model = getattr(transformers, arch)(hf_config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, param in sorted(model.state_dict().items()):
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue  # tied checkpoints store only the embedding, as Qwen3-0.6B does
        tensors.update(_per_expert(name, _init_tensor(name, tuple(param.shape), gen)))
    save_file(tensors, str(path), metadata={"format": "pt"})


def _per_expert(name: str, tensor):
    """transformers 5.x holds experts fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`);
    checkpoints, as its save_pretrained writes them, name each expert's gate/up/down."""
    prefix = name.rpartition(".experts.")[0] + ".experts"
    if name.endswith(".experts.gate_up_proj"):
        gate, up = tensor.chunk(2, dim=1)
        return {**{f"{prefix}.{e}.gate_proj.weight": g.clone() for e, g in enumerate(gate)},
                **{f"{prefix}.{e}.up_proj.weight": u.clone() for e, u in enumerate(up)}}
    if name.endswith(".experts.down_proj"):
        return {f"{prefix}.{e}.down_proj.weight": d.clone() for e, d in enumerate(tensor)}
    return {name: tensor}


def _init_tensor(name: str, shape: tuple[int, ...], gen) -> "torch.Tensor":
    import torch

    if name.endswith("norm.weight"):
        return 1.0 + TINY_NORM_JITTER * torch.randn(shape, generator=gen)
    std = TINY_EMBED_STD if "embed_tokens" in name else TINY_INIT_STD
    return std * torch.randn(shape, generator=gen)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory to write the checkpoint into")
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS),
                        help="tiny, tiny-moe*: random weights; qwen3-*: real shapes, config + tokenizer only")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (tiny preset)")


def run(args: argparse.Namespace) -> int:
    out = build_tiny_model(args.out, preset=args.preset, seed=args.seed)
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem tiny-model", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())


# Training text for the tokenizer: varied English, numbers, code, other scripts, emoji.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model is still a model: it reads tokens,
mixes them in attention, and writes a distribution over the next token.
Once upon a time, in a town beside a cold river, there lived a baker who woke before the sun.
She baked bread, buns and little cakes, and the whole street smelled of butter and warm sugar.
Every morning the children ran past her window on their way to school, and every morning she
waved at them. "Good morning!" they shouted. "Good morning to you," she answered, smiling.
In the evening the town was quiet. The river kept moving, the lamps were lit one by one, and
the baker counted the coins in her drawer: seven, eight, nine, ten. It was enough for today.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
Question: Which planet is closest to the sun? Answer: Mercury is the closest planet to the sun.
User: Can you help me write a short poem about the sea?
Assistant: Of course. Here is a short poem: The sea is wide, the sea is deep, it sings the
shore and sailors to sleep.
User: Thank you! Could you also explain what a neural network is?
Assistant: A neural network is a function built from layers. Each layer multiplies its input by
a matrix of weights, adds a bias, and applies a nonlinearity. Training changes the weights so
that the outputs get closer to the targets, one small gradient step at a time.
Reinforcement learning trains a policy from rewards. The policy generates a response, a reward
function scores it, and the update makes good responses more likely and bad ones less likely.
Rollouts are generated by an inference engine, and the trainer computes the loss on them.
The scheduler decides which requests run in the next batch. The cache keeps the keys and values
of earlier tokens, so a shared prefix does not have to be computed again.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 42 64 100 128 256 512 1024 2048.
Prices went from $3.50 to $4.25, a rise of 21.4%. The meeting is at 09:30 on 2024-05-17.
Call 555-0199 or write to team@example.com before 5 pm. Version 1.2.3 was released in March.
3 + 4 = 7; 12 * 12 = 144; 100 / 8 = 12.5; 2 ** 10 = 1024; sqrt(81) = 9; 7 - 10 = -3.
What is 15 + 27? The answer is 42. What is 9 * 8? The answer is 72. What is 81 / 9? It is 9.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

class Counter:
    def __init__(self):
        self.count = 0

    def add(self, value=1):
        self.count += value
        return self.count

import json
data = {"name": "tandem", "version": "0.1.0", "tags": ["llm", "serving", "rl"], "ok": true}
print(json.dumps(data, indent=2))
if x == None or y != 0 and not done: result = [a[i] for i in range(len(a)) if a[i] > 0]
#include <stdio.h>
int main(void) { printf("hello, world\\n"); return 0; }
SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY name;
<html><body><p class="note">Hello &amp; welcome</p></body></html>
Le petit chat dort sur le canapé. Où est la gare ? Nous allons à la plage demain matin.
Der schnelle braune Fuchs springt über den faulen Hund. Straße, Größe, schön, Mädchen.
El niño come una manzana roja. ¿Dónde está la biblioteca? ¡Qué día tan bonito, señor!
Привет, мир! Как дела? Сегодня хорошая погода, и мы идём гулять в парк.
مرحبا بالعالم. كيف حالك اليوم؟
你好，世界！今天天气很好，我们一起去公园散步吧。机器学习是人工智能的一个分支。
模型生成文本，训练器计算损失，然后更新权重。北京是中国的首都。
こんにちは、世界！今日はいい天気ですね。猫がソファで寝ています。
안녕하세요, 세계! 오늘 날씨가 좋네요. 고양이가 소파에서 자고 있어요.
Emoji: 😀 😂 🙂 🚀 🎉 ❤️ 👍 🔥 ✨ 🌍 🍕 🐍 — arrows → ← ↑ ↓, math ∑ ∫ √ π ≈ ≠ ≤ ≥ ∞ °C.
The weather today is sunny with a light wind from the west. Tomorrow it may rain in the
afternoon, so take an umbrella if you go out. The temperature will be around 18 degrees.
A list of things to do: buy milk, call mom, finish the report, water the plants, go running.
First, open the box. Second, take out the parts. Third, read the instructions carefully.
Finally, put the parts together and check that everything works before you throw away the box.
The library opens at nine and closes at six. Students may borrow up to five books at a time.
History is the study of the past. People write it down so that others can learn from it.
The train to the city leaves every twenty minutes, and the ride takes about half an hour.
He said that he would come back later, but he never did. She waited by the door until dark.
They walked along the beach, talking about their plans for the summer and the years ahead.
It is important to test your code. Write small tests, run them often, and fix what breaks.
When the program starts, it reads the config file, loads the weights, and waits for requests.
Each request has a prompt, a list of sampling parameters, and a maximum number of new tokens.
The engine returns the generated text, the output token ids, and some metadata about timing.
Good software is simple, clear and correct. Clever code is hard to read and harder to fix.
Water boils at 100 degrees Celsius at sea level. Ice melts at 0 degrees. The sky looks blue.
Cats, dogs, birds, fish, horses and rabbits are common pets in many parts of the world.
Apples, oranges, bananas, grapes, pears, peaches and cherries are fruits that people love.
Red, orange, yellow, green, blue, indigo and violet are the colors of the rainbow.
January, February, March, April, May, June, July, August, September, October, November,
December. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, hundred.
"""
