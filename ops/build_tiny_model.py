"""Build the tiny Llama test model: a config for random (dummy) weights and a byte-level BPE
tokenizer trained on the seeded synthetic corpus. The output is committed under
ops/tiny-llama/; running this again reproduces it byte for byte.

    python ops/build_tiny_model.py [OUTPUT_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jobsvc.workloads import training_corpus

VOCAB_SIZE = 4096
CONTEXT = 4096
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": CONTEXT,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 0,
    "eos_token_id": 1,
    # float32: bfloat16 runs 1.7-3.1x slower on CPUs without native bfloat16. vLLM's "auto"
    # dtype would still serve it as bfloat16 on x86, so the settings ask for float32.
    "torch_dtype": "float32",
}

# A plain chat format for the OpenAI chat endpoint of `jobsvc serve`: each message under its
# role's tag and closed by the end-of-sequence token, then the assistant's tag.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "model_max_length": CONTEXT,
    "add_bos_token": True,
    "chat_template": CHAT_TEMPLATE,
}


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(paragraphs=4000), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)])
    return tokenizer


def build(output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    train_tokenizer().save(str(output / "tokenizer.json"), pretty=False)
    for name, content in (("config.json", CONFIG), ("tokenizer_config.json", TOKENIZER_CONFIG),
                          ("generation_config.json", {"bos_token_id": 0, "eos_token_id": 1})):
        (output / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "tiny-llama")
