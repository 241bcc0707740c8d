"""`kha serve`: transformers' OpenAI-compatible server with a KHA checkpoint, checked with the `openai` client
against `model.generate` (greedy), with and without continuous batching, plain and streamed."""

import socket

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

from kha_hf import KHAForCausalLM
from kha_hf.cli import main
from kha_hf.serving.server import CPU_CB_MAX_BATCH_TOKENS, CPU_CB_NUM_BLOCKS
from tests.helpers import free_port, randomize_knocks, save_tiny_tokenizer, tiny_configs

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPT = "the quick brown"
MESSAGES = [{"role": "user", "content": "the lazy dog"}]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def kha_dir(tmp_path_factory):
    """A tiny Qwen3 KHA model with trained-looking (random) knocks and a tokenizer with a chat template."""
    folder = tmp_path_factory.mktemp("serve") / "kha"
    config = tiny_configs()["qwen3"]
    config.vocab_size = 300
    torch.manual_seed(0)
    kha = KHAForCausalLM.from_base(AutoModelForCausalLM.from_config(config), knock="mlp_v_linear_qk")
    randomize_knocks(kha)
    kha.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def greedy(folder, ids) -> str:
    model = KHAForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("continuous_batching", [False, True])
def test_openai_client_gets_what_generate_gives(kha_dir, continuous_batching):
    from kha_hf.serving.server import start_server

    tokenizer = AutoTokenizer.from_pretrained(kha_dir)
    expected_text = greedy(kha_dir, tokenizer(PROMPT, return_tensors="pt").input_ids)
    chat_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt")
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    expected_chat = greedy(kha_dir, chat_ids)

    port = free_port()
    rss_before = psutil.Process().memory_info().rss
    server = start_server(
        str(kha_dir), port=port, device="cpu", dtype="float32", continuous_batching=continuous_batching
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
        assert str(kha_dir) in [m.id for m in client.models.list().data]
        common = dict(model=str(kha_dir), max_tokens=NEW_TOKENS, temperature=0)
        text = client.completions.create(prompt=PROMPT, **common).choices[0].text
        assert text == expected_text
        chat = client.chat.completions.create(messages=MESSAGES, **common).choices[0].message.content
        assert chat == expected_chat
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(messages=MESSAGES, stream=True, **common)
            if chunk.choices
        )
        assert streamed == expected_chat
        # transformers alone sizes the paged KV cache from the machine's RAM on a CPU (5.24: 11 GiB here for this
        # 2-layer model; 5.25: 60 % of the RAM); kha serve caps it at 64 blocks of 256 tokens, a few MiB for this
        # model. The model runs in a process of its own (transformers >= 5.25): both processes are measured.
        grown = psutil.Process().memory_info().rss - rss_before
        assert grown < 1 << 30, f"the server grew the process by {grown / 2**30:.1f} GiB"
        [engine] = server.model_manager.engines.values()
        model_rss = psutil.Process(engine.managed_process.pid).memory_info().rss
        assert model_rss < 3 << 30, f"the model's process holds {model_rss / 2**30:.1f} GiB"
    finally:
        server.kill_server()


def test_generate_batch_with_paged_attention_gives_generate_tokens(kha_dir):
    model = KHAForCausalLM.from_pretrained(kha_dir, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(kha_dir)
    prompts = [tokenizer(p).input_ids for p in (PROMPT, "over the lazy dog", "to be")]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # sized as kha serve sizes it on a CPU: transformers' default would take most of the machine's RAM (14.8 GiB)
    cache = ContinuousBatchingConfig(num_blocks=CPU_CB_NUM_BLOCKS, max_batch_tokens=CPU_CB_MAX_BATCH_TOKENS)
    batch = model.generate_batch(
        inputs=prompts, generation_config=config, continuous_batching_config=cache, progress_bar=False
    )
    for request, ids in zip(sorted(batch), prompts, strict=True):
        single = model.generate(torch.tensor([ids]), generation_config=config)[0, len(ids) :].tolist()
        assert batch[request].generated_tokens == single


def test_port_in_use_is_a_one_line_error(kha_dir, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(kha_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kha serve: error: cannot listen on 127.0.0.1:") and len(err.splitlines()) == 1


@pytest.mark.slow
def test_smollm2_kha_served_equals_generate(tmp_path):
    from kha_hf.common.assets import smollm2_gguf
    from kha_hf.conversion import convert
    from kha_hf.serving.server import start_server

    folder = convert(smollm2_gguf(), tmp_path / "smollm2-kha", progress=False).output
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    expected = greedy(folder, chat_ids)
    port = free_port()
    server = start_server(str(folder), port=port, device="cpu", dtype="float32")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300, max_retries=0)
        reply = client.chat.completions.create(
            model=str(folder), messages=messages, max_tokens=NEW_TOKENS, temperature=0
        )
        assert reply.choices[0].message.content == expected
    finally:
        server.kill_server()


def test_continuous_batching_cache_is_bounded_on_a_cpu_and_left_to_transformers_on_a_gpu():
    from kha_hf.serving.server import CPU_CB_MAX_BATCH_TOKENS, CPU_CB_NUM_BLOCKS, cb_sizes

    assert cb_sizes("cpu", None, None) == {"cb_num_blocks": CPU_CB_NUM_BLOCKS, "cb_max_batch_tokens": 512}
    assert cb_sizes("cpu", 8, 128) == {"cb_num_blocks": 8, "cb_max_batch_tokens": 128}  # the user's numbers win
    assert cb_sizes("cuda", None, None) == {"cb_num_blocks": None, "cb_max_batch_tokens": None}
    assert CPU_CB_MAX_BATCH_TOKENS == 512
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "x", "--cb-num-blocks", "0"])
    assert exit_info.value.code == 2


def test_serve_refuses_a_transformers_release_older_than_its_server_and_warns_on_a_newer_one(
    kha_dir, capsys, monkeypatch
):
    """transformers' serving module is internal and was rewritten in 5.25.0 (the model in a process of its own):
    `kha serve` refuses an older release in one line naming the one it needs, instead of an ImportError mid-start, and
    serves on a newer (untested) release with one warning. setup.cfg's [serve] extra admits the release it needs."""
    import configparser
    import warnings

    import transformers
    from packaging.requirements import Requirement

    from kha_hf.serving.server import SERVING_TRANSFORMERS, UntestedServingWarning, check_serving_transformers

    floor = "{}.{}".format(*SERVING_TRANSFORMERS)
    setup = configparser.ConfigParser()
    setup.read("setup.cfg")
    lines = [line.split("#")[0].strip() for line in setup["options.extras_require"]["serve"].splitlines()]
    serve_extra = [Requirement(line) for line in lines if line]
    [extra] = [r for r in serve_extra if r.name == "transformers"]
    assert "serving" in extra.extras and extra.specifier.contains(f"{floor}.0"), "setup.cfg's [serve] refuses it"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_serving_transformers()  # the installed release (the suite's)
        check_serving_transformers(f"{floor}.0")
    for version in ("5.24.0", "5.16.1", "4.57.0", "5.24.9"):
        with pytest.raises(Exception, match=rf"kha serve needs transformers>={floor} .*installed: {version}: pip"):
            check_serving_transformers(version)
    for version in ("5.26.0", "6.0.0"):
        with pytest.warns(UntestedServingWarning, match=version):
            check_serving_transformers(version)
    monkeypatch.setattr(transformers, "__version__", "5.24.0")
    assert main(["serve", str(kha_dir), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kha serve: error: kha serve needs transformers>={floor}") and len(err.splitlines()) == 1
    assert f"pip install 'transformers>={floor}'" in err
