"""Case T2: chat templates with HF-only template features ({% generation %}, namespace, dict,
loop controls) render exactly as HF transformers renders them (Gemma- and Qwen-style templates)."""

import json

import pytest

from infertrace.tokenizer.vocab import Tokenizer
from tests.helpers.tiny import make_weights, write_hf

transformers = pytest.importorskip("transformers")

GEMMA = (
    "{{ bos_token }}{% set ns = namespace(first=true) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.first = false %}{{ message['content'] }}\n\n{% continue %}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}<end_of_turn>\n{% endgeneration %}"
    "{% else %}{{ message['content'] | trim }}<end_of_turn>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
QWEN = (
    "{%- set meta = dict(sys='You are helpful.') -%}"
    "{%- if messages[0]['role'] != 'system' -%}<|im_start|>system\n{{ meta.sys }}<|im_end|>\n{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.index0 > 5 %}{% break %}{% endif -%}"
    "<|im_start|>{{ message.role }}\n"
    "{%- if message.role == 'assistant' -%}{%- generation -%}{{ message.content }}<|im_end|>{%- endgeneration -%}"
    "{%- else -%}{{ message.content }}<|im_end|>{%- endif %}\n"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there "},
    {"role": "assistant", "content": "Hello! {curly} <b>tags</b>"},
    {"role": "user", "content": "Bye"},
]


@pytest.mark.parametrize("template", [GEMMA, QWEN], ids=["gemma", "qwen"])
@pytest.mark.parametrize("add_gen", [True, False])
def test_hf_only_tags_render_as_hf(tmp_path, template, add_gen):
    w, s = make_weights()
    d = write_hf(tmp_path / "hf", w, s)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(chat_template=template, bos_token="<|endoftext|>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = Tokenizer.from_hf_dir(d).apply_chat_template(MESSAGES, add_generation_prompt=add_gen)
    hf = transformers.AutoTokenizer.from_pretrained(str(d)).apply_chat_template(MESSAGES, tokenize=False,
                                                                                add_generation_prompt=add_gen)
    assert ours == hf
    assert "Hello! {curly} <b>tags</b>" in ours  # the generation body is rendered, unescaped


def test_namespace_refuses_underscore_names(tmp_path):
    from infertrace.errors import InfertraceError

    w, s = make_weights()
    d = write_hf(tmp_path / "hf", w, s)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InfertraceError, match="underscore"):
        Tokenizer.from_hf_dir(d).apply_chat_template(MESSAGES)
