import contextlib
import os
import subprocess
import sys

import pytest

import mlxinfer
from mlxinfer import load as mlxinfer_load

from .conftest import write_empty_gguf


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mlxinfer.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def assert_one_line_error(r, *fragments):
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxinfer: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_generate_default_model_says_paris(smollm2_path):
    """The README's first command: a question to the Instruct model is wrapped in the file's chat
    template by default (as mlx-lm's CLI does) and answered; --raw continues the text as it is."""
    question = "What is the capital of France?"
    r = run_cli("generate", "--backend", "cpu", "--max-tokens", "8", question)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "backend" not in r.stdout  # stdout holds only the text
    block = r.stderr
    assert block.startswith("\nbackend: cpu (") and "\nkv cache: prealloc\nattention: fused\n" in block
    assert "time_to_first_token_ms:" in block and "generated_tokens: " in block
    tokenizer = mlxinfer_load(smollm2_path, backend="cpu").tokenizer
    templated = tokenizer.encode(question, add_special=True)
    assert tokenizer.chat_template and f"prompt_tokens: {len(templated)}  (" not in block  # not the bare text
    for raw in ("--raw", "--ignore-chat-template"):
        r = run_cli("generate", "--backend", "cpu", "--max-tokens", "8", raw, "The capital of France is")
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(" Paris")
        assert "generated_tokens: 8" in r.stderr and "(n=7)" in r.stderr
        assert "prompt_tokens: 5  (prefill chunk 512)" in r.stderr and "finish_reason: length" in r.stderr
    assert_one_line_error(run_cli("generate", "--raw", "--chat", "hi"), "--raw", "not with --chat")


def test_generate_options_reach_the_engine(smollm2_path):
    r = run_cli("generate", "--backend", "cpu", "--max-tokens", "8", "--kv", "basic", "--prefill-chunk", "2",
                "--attention", "per-head", "--stop", " answer", "--quiet", "--raw", "The capital of France is")
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and r.stdout.startswith(" Paris")
    free = run_cli("generate", "--backend", "cpu", "--max-tokens", "8", "--quiet", "--raw", "The capital of France is")
    assert free.stdout.startswith(r.stdout.rstrip("\n"))
    assert " answer" in free.stdout and " answer" not in r.stdout  # the stop string was applied
    r = run_cli("generate", "--backend", "cpu", "--max-tokens", "8", "--kv", "basic", "--prefill-chunk", "2",
                "--attention", "per-head", "--raw", "The capital of France is")
    assert "kv cache: basic" in r.stderr and "attention: per-head" in r.stderr and "(prefill chunk 2)" in r.stderr


def test_generate_sampling_options(smollm2_path):
    def run(*opts):
        r = run_cli("generate", "--backend", "cpu", "--max-tokens", "12", "--quiet", "--raw", *opts, "Once upon a time")
        assert r.returncode == 0, r.stderr
        return r.stdout

    greedy = run()
    assert run("--temp", "1.5", "--seed", "1") != greedy
    assert run("--temp", "1.5", "--seed", "1", "--top-k", "1") == greedy
    assert run("--temp", "1.5", "--seed", "1", "--top-p", "0.000001") == greedy
    assert run("--temp", "1.5", "--seed", "1", "--min-p", "1") == greedy
    assert run("--temp", "1.5", "--seed", "7") == run("--temp", "1.5", "--seed", "7")
    assert run("--temp", "1.5", "--seed", "-1") is not None  # llama.cpp's "random seed": no error
    # the penalties reach the sampler (greedy: a penalised token changes the text from where it repeats)
    assert run("--repeat-penalty", "1.5") != greedy
    assert run("--presence-penalty", "2", "--frequency-penalty", "2") != greedy
    r = run_cli("generate", "--backend", "cpu", "--presence-penalty", "3", "hi")
    assert r.returncode != 0 and "presence_penalty must be in [-2, 2]" in r.stderr and "Traceback" not in r.stderr


def test_generate_chat_mode(smollm2_path):
    r = run_cli("generate", "--model", smollm2_path, "--backend", "cpu", "--chat", "--max-tokens", "24",
                "What is the capital of France? Answer in one word.")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_inspect_prints_model_summary(smollm2_path):
    r = run_cli("inspect", smollm2_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "architecture: llama" in out
    assert "block_count: 30" in out and "attention.head_count_kv: 3" in out
    assert "pre-tokenizer 'smollm'" in out and "49152 tokens" in out
    assert "token_embd.weight" in out and "Q8_0" in out and "[49152, 576]" in out and "30081024" in out
    assert "blk.29.ffn_down.weight" in out


def test_missing_file(tmp_path):
    assert_one_line_error(run_cli("generate", "--model", str(tmp_path / "none.gguf"), "hi"), "none.gguf", "no such file")
    assert_one_line_error(run_cli("inspect", str(tmp_path / "none.gguf")), "no such file")
    r = subprocess.run([sys.executable, "-m", "mlxinfer.cli", "generate", "hi"], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "MLXINFER_MODEL": str(tmp_path / "gone.gguf")})
    assert_one_line_error(r, "gone.gguf: no such file (from the environment variable MLXINFER_MODEL)")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("hello, I am a text file\n")
    assert_one_line_error(run_cli("generate", "--model", str(p), "hi"), "model.gguf", "not a GGUF file")


def test_unsupported_architecture(tmp_path):
    p = write_empty_gguf(tmp_path / "falcon.gguf", "falcon")
    assert_one_line_error(run_cli("generate", "--model", p, "hi"), "architecture 'falcon' is not supported")


def test_unsupported_tensor_type(tmp_path, synthetic):
    from mlxinfer.synthetic import write_synthetic_model

    p = write_synthetic_model(tmp_path / "q3k.gguf", arch="llama", n_layers=1, hidden=256, ffn=256, n_heads=4,
                              n_kv_heads=2, head_dim=64, qtype="Q3_K", random_blocks=True)
    # rewrite one tensor's type code to IQ3_S (not read; the same block geometry as Q3_K)
    from mlxinfer.gguf_file import GGUFFile
    import struct

    data = bytearray(open(p, "rb").read())
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == 11  # Q3_K
    struct.pack_into("<I", data, type_at, 21)  # IQ3_S
    open(p, "wb").write(bytes(data))
    assert GGUFFile(p).tensor("blk.0.ffn_up.weight").type_name == "IQ3_S"
    for backend in ("cpu", "mlx"):
        assert_one_line_error(run_cli("generate", "--model", str(p), "--backend", backend, "hi"),
                              "blk.0.ffn_up.weight", "IQ3_S", "not support")


def test_missing_tensor(tmp_path):
    from mlxinfer.synthetic import rewrite_gguf, write_synthetic_model

    src = write_synthetic_model(tmp_path / "full.gguf", arch="qwen3", n_layers=2)
    dst = rewrite_gguf(src, tmp_path / "missing.gguf", drop_tensors={"blk.1.attn_k_norm.weight"})
    assert_one_line_error(run_cli("generate", "--model", dst, "--backend", "cpu", "hi"),
                          "missing.gguf", "missing tensor 'blk.1.attn_k_norm.weight'")


def test_prompt_longer_than_context(tmp_path):
    from mlxinfer.synthetic import write_synthetic_model

    p = write_synthetic_model(tmp_path / "short.gguf", arch="llama", n_layers=1, context_length=16)
    assert_one_line_error(run_cli("generate", "--model", p, "--backend", "cpu", "--max-tokens", "4", "word " * 20),
                          "exceeds the model's context length 16")


@pytest.mark.parametrize("args,fragment", [
    (["--backend", "tpu"], "invalid choice: 'tpu'"),
    (["--attention", "flash"], "invalid choice: 'flash'"),
    (["--kv", "pages"], "invalid choice: 'pages'"),
    (["--backend", "cpu", "--prefill-chunk", "0"], "prefill chunk must be a positive integer, got 0"),
    (["--backend", "cpu", "--stop", ""], "stop string must be non-empty"),
    (["--backend", "cpu", "--min-p", "3"], "min_p must be in [0, 1]"),
])
def test_bad_option_values(args, fragment):
    assert_one_line_error(run_cli("generate", *args, "hi"), fragment)


def test_runtime_request_errors(tmp_path):
    from mlxinfer.synthetic import write_synthetic_model

    p = write_synthetic_model(tmp_path / "m.gguf", arch="llama", n_layers=1, context_length=64)
    assert_one_line_error(run_cli("generate", "--model", p, "--backend", "cpu", ""), "empty prompt")
    assert_one_line_error(run_cli("generate", "--model", p, "--backend", "cpu", "--device", "gpu", "hi"),
                          "the cpu backend runs on the CPU only")
    try:
        from mlxinfer.backends import mlx_gpu_available
    except ImportError:
        mlx_gpu_available = None
    if mlx_gpu_available is not None and not mlx_gpu_available():  # auto + --device gpu: MLX's own answer
        assert_one_line_error(run_cli("generate", "--model", p, "--device", "gpu", "hi"),
                              "--device gpu: MLX has no GPU here")
    assert_one_line_error(run_cli("generate", "--model", p, "--backend", "cpu", "--max-tokens", "0", "hi"),
                          "--max-tokens must be a positive integer, got 0")
    assert_one_line_error(run_cli("generate", "--model", p, "--backend", "cpu", "word " * 70),
                          "exceeds the model's context length 64")
    r = subprocess.run([sys.executable, "-m", "mlxinfer.cli", "generate", "--model", p, "--backend", "cpu",
                        b"caf\xe9 \xff"], capture_output=True, text=True)
    assert_one_line_error(r, "prompt is not valid UTF-8")
    assert r.stdout == ""  # nothing printed as if generation had happened


def test_dtype_options(tmp_path):
    """--dtype and --kv-dtype: the MLX backend runs them (here a bfloat16 model over a q8_0 cache); what
    cannot run is one line: the cpu backend (float32 only), a basic cache asked to store another type,
    a q8_0 cache of rows that are not whole blocks of 32, an unknown type."""
    from mlxinfer.synthetic import write_synthetic_model

    p = write_synthetic_model(tmp_path / "m.gguf", arch="llama", n_layers=1)  # KV rows of 2 x 32 values
    odd = write_synthetic_model(tmp_path / "odd.gguf", arch="llama", n_layers=1, n_kv_heads=1, head_dim=16)
    mlx = ("--backend", "mlx", "--device", "cpu", "-n", "3", "--quiet")
    r = run_cli("generate", "--model", p, *mlx, "--dtype", "bfloat16", "--kv-dtype", "q8_0", "hi")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert_one_line_error(run_cli("generate", "--model", p, "--backend", "cpu", "--dtype", "bfloat16", "hi"),
                          "--dtype bfloat16: the cpu backend computes and stores float32 only")
    assert_one_line_error(run_cli("generate", "--model", p, "--backend", "cpu", "--kv-dtype", "q8_0", "hi"),
                          "--kv-dtype q8_0: the cpu backend")
    assert_one_line_error(run_cli("generate", "--model", p, *mlx, "--kv", "basic", "--kv-dtype", "q8_0", "hi"),
                          "a --kv-dtype other than --dtype needs --kv prealloc or paged")
    assert_one_line_error(run_cli("generate", "--model", odd, *mlx, "--kv-dtype", "q8_0", "hi"),
                          "--kv-dtype q8_0 quantizes KV rows in blocks of 32 values; this model's rows hold 16")
    assert_one_line_error(run_cli("generate", "--model", p, *mlx, "--dtype", "float64", "hi"),
                          "argument --dtype: invalid choice: 'float64'")


def test_device_gpu_without_a_gpu(tmp_path):
    from mlxinfer.backends import mlx_gpu_available
    from mlxinfer.synthetic import write_synthetic_model

    if mlx_gpu_available():
        pytest.skip("this machine has an MLX GPU")
    p = write_synthetic_model(tmp_path / "m.gguf", arch="llama", n_layers=1)
    assert_one_line_error(run_cli("generate", "--model", p, "--backend", "mlx", "--device", "gpu", "hi"),
                          "--device gpu: MLX has no GPU here")
    assert_one_line_error(run_cli("generate", "--model", p, "--backend", "mlx", "--kernel", "cuda", "hi"),
                          "the cuda attention kernel needs an MLX cuda GPU device")


def test_version_and_module_entry_point():
    from mlxinfer import __version__

    r = subprocess.run([sys.executable, "-m", "mlxinfer", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"mlxinfer {__version__}"
    r = subprocess.run([sys.executable, "-m", "mlxinfer", "generate", "--help"], capture_output=True, text=True)
    assert "--prefill-chunk" in r.stdout and "(default: 64)" in r.stdout  # defaults shown in --help


def test_prompt_from_stdin_and_from_a_file(tmp_path, smollm2_path):
    args = ["generate", "--backend", "cpu", "--max-tokens", "6", "--quiet"]
    want = run_cli(*args, "The capital of France is").stdout
    r = subprocess.run([sys.executable, "-m", "mlxinfer", *args, "-"], input="The capital of France is",
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == want
    f = tmp_path / "prompt.txt"
    f.write_text("The capital of France is")
    assert run_cli(*args, "--prompt-file", str(f)).stdout == want
    assert_one_line_error(run_cli(*args, "--prompt-file", str(tmp_path / "none.txt")), "cannot read the prompt file")
    assert_one_line_error(run_cli(*args), "no prompt")


def test_max_tokens_past_the_context_is_capped_with_a_notice(tmp_path):
    from mlxinfer.synthetic import write_synthetic_model

    p = write_synthetic_model(tmp_path / "short.gguf", arch="llama", n_layers=1, context_length=16)
    r = run_cli("generate", "--model", p, "--backend", "cpu", "--max-tokens", "100", "--quiet", "--raw", "a b c")
    assert r.returncode == 0, r.stderr
    notice = [x for x in r.stderr.splitlines() if x.startswith("mlxinfer: note:")]
    assert len(notice) == 1 and "--max-tokens 100 capped to" in notice[0] and "context length 16" in notice[0]


def test_threads_option(tmp_path):
    from mlxinfer.synthetic import write_synthetic_model

    p = write_synthetic_model(tmp_path / "m.gguf", arch="llama", n_layers=1)
    r = run_cli("generate", "--model", p, "--backend", "cpu", "--threads", "1", "--max-tokens", "2", "hi")
    assert r.returncode == 0 and "backend: cpu (1 BLAS thread)" in r.stderr
    assert_one_line_error(run_cli("generate", "--model", p, "--backend", "cpu", "--threads", "0", "hi"),
                          "threads must be an integer from 1 to")
    limit = 4 * (os.cpu_count() or 1)
    assert_one_line_error(run_cli("generate", "--model", p, "--backend", "cpu", "--threads", str(limit + 1), "hi"),
                          f"threads must be an integer from 1 to {limit} (4 per core here), got {limit + 1}")
    r = run_cli("generate", "--model", p, "--backend", "mlx", "--device", "cpu", "--threads", "2", "--max-tokens", "2", "hi")
    assert r.returncode == 0 and "2 threads)" in r.stderr
    assert_one_line_error(run_cli("generate", "--model", p, "--backend", "mlx", "--device", "cpu", "--threads", "100000",
                                  "hi"), "threads must be an integer from 1 to")


def test_inspect_sorts_tensors_naturally(tmp_path):
    from mlxinfer.synthetic import write_synthetic_model

    p = write_synthetic_model(tmp_path / "m.gguf", arch="llama", n_layers=12)
    out = run_cli("inspect", p).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith("  blk.")]
    layers = [int(n.split(".")[1]) for n in names]
    assert layers == sorted(layers) and layers[-1] == 11


def test_chat_reads_turns_from_stdin_and_resets(smollm2_path):
    r = subprocess.run([sys.executable, "-m", "mlxinfer", "chat", "--backend", "cpu", "--max-tokens", "12",
                        "--system", "Answer in one word."],
                       input="What is the capital of France?\n/reset\nAnd of Italy?\n", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "(history cleared)" in r.stdout
    assert r.stdout.count("> ") == 0  # no prompt echo when stdin is not a terminal


def test_chat_loop_keeps_history_and_survives_ctrl_c(tmp_path):
    import mlxinfer
    from mlxinfer.cli import run_chat
    from mlxinfer.synthetic import write_synthetic_model

    engine = mlxinfer.load(write_synthetic_model(tmp_path / "m.gguf", arch="qwen3", n_layers=1, vocab_size=320),
                           backend="cpu")
    seen = []
    lines = iter(["hello", "again", "/reset", "third"])
    writes = []

    def write(text):
        writes.append(text)
        if len(writes) == 3:  # Ctrl-C in the middle of the first reply
            raise KeyboardInterrupt

    original = engine.encode_prompt

    def spy(prompt, **kw):
        if isinstance(prompt[0], dict):  # a conversation rendered and tokenized (ids are only checked)
            seen.append([dict(m) for m in prompt])
        return original(prompt, **kw)

    engine.encode_prompt = spy
    def read_line(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    run_chat(engine, read_line, write, system="sys", max_tokens=6)
    assert " [stopped]" in writes  # the reply stopped, the chat went on
    assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "user"]  # history kept
    assert seen[1][2]["content"] == "".join(writes[:2])  # with what had been said before Ctrl-C
    assert [m["role"] for m in seen[2]] == ["system", "user"]  # after /reset
    assert len(seen) == 3  # each turn's conversation tokenized once


def test_the_package_exports_what_it_lists():
    """`mlxinfer.MlxinferError` and the rest of `__all__` are reachable from the package (the README's
    API promises them)."""
    import mlxinfer

    assert [name for name in mlxinfer.__all__ if not hasattr(mlxinfer, name)] == []
    assert issubclass(mlxinfer.RequestError, mlxinfer.MlxinferError)


def test_generate_into_a_closed_pipe_stops_quietly(tmp_path, monkeypatch, capsys):
    """`mlxinfer generate ... | head -c 1`: once the reader has gone, a write raises BrokenPipeError;
    the command stops with the shell's status for it (141) and no traceback."""
    from mlxinfer.cli import main
    from mlxinfer.synthetic import write_synthetic_model

    path = write_synthetic_model(tmp_path / "m.gguf", arch="qwen3", n_layers=1, vocab_size=320)

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            raise OSError("no descriptor")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["generate", "--model", str(path), "--backend", "cpu", "--max-tokens", "4", "hello"]) == 141
    assert "Traceback" not in capsys.readouterr().err


def test_closed_streams_a_full_disk_and_chat_options(tmp_path):
    """stdin or stdout closed, stdout on a full disk, chat's bad options, serve's too small KV budget:
    one line and status 1 each, refused before any turn or any listening."""
    from mlxinfer.synthetic import write_synthetic_model

    p = write_synthetic_model(tmp_path / "m.gguf", arch="qwen3", n_layers=1, vocab_size=320)
    cmd = f"{sys.executable} -m mlxinfer.cli"

    def sh(line):
        return subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120)

    assert_one_line_error(sh(f"{cmd} generate --model {p} --backend cpu - <&-"), "stdin is closed")
    assert_one_line_error(sh(f"echo hi | {cmd} chat --model {p} --backend cpu <&-"), "stdin, which is closed")
    assert_one_line_error(sh(f"{cmd} generate --model {p} --backend cpu hi >&-"), "stdout is closed")
    if os.path.exists("/dev/full"):
        for line in (f"{cmd} generate --model {p} --backend cpu --max-tokens 4 hi >/dev/full",
                     f"echo hi | {cmd} chat --model {p} --backend cpu --max-tokens 4 >/dev/full",
                     f"{cmd} inspect {p} >/dev/full"):
            assert_one_line_error(sh(line), "writing the output: No space left on device")
    assert_one_line_error(sh(f"{cmd} generate --model {p} --backend cpu --stop $'\\xff' hi"), "--stop is not valid UTF-8")
    for args, fragment in ((["--max-tokens", "0"], "--max-tokens must be a positive integer, got 0"),
                           (["--temp", "nan"], "temperature must be a finite number"),
                           (["--stop", ""], "stop string must be non-empty")):
        r = subprocess.run([sys.executable, "-m", "mlxinfer.cli", "chat", "--model", p, "--backend", "cpu", *args],
                           input="hi\n", capture_output=True, text=True, timeout=120)
        assert_one_line_error(r, fragment)
        assert r.stdout == ""
    assert_one_line_error(run_cli("serve", "--model", p, "--backend", "cpu", "--kv-memory", "1000", "--port", "1"),
                          "kv_memory 1000 holds less than one block of 16 positions")


def test_verbose_says_what_was_loaded_and_the_seed_even_when_quiet(tmp_path):
    from mlxinfer.synthetic import write_synthetic_model

    p = write_synthetic_model(tmp_path / "m.gguf", arch="llama", n_layers=1, context_length=64)
    base = ["generate", "--model", p, "--backend", "cpu", "--max-tokens", "3", "--temp", "0.8", "hi"]
    loud = run_cli(*base, "--verbose", "--seed", "77")
    assert loud.returncode == 0, loud.stderr
    assert f"mlxinfer: {p}: llama, 1 layers" in loud.stderr and "\n  seed: 77\n" in loud.stderr
    quiet = run_cli(*base, "--verbose", "--quiet", "--seed", "77")
    assert quiet.returncode == 0 and quiet.stdout == loud.stdout
    assert quiet.stderr.strip().splitlines()[-1] == "mlxinfer: seed 77" and "metrics:" not in quiet.stderr
    plain = run_cli(*base, "--seed", "77")
    assert "seed" not in plain.stderr and plain.stdout == loud.stdout


def test_generate_tokenizes_the_prompt_once(tmp_path, monkeypatch, capsys):
    """The prompt is encoded once: the same ids cap --max-tokens and are generated from."""
    from mlxinfer.cli import main
    from mlxinfer.synthetic import write_synthetic_model
    from mlxinfer.tokenizer import GGUFTokenizer

    path = write_synthetic_model(tmp_path / "m.gguf", arch="qwen3", n_layers=1, vocab_size=320)
    calls = []
    encode = GGUFTokenizer.encode
    monkeypatch.setattr(GGUFTokenizer, "encode", lambda self, *a, **k: calls.append(a) or encode(self, *a, **k))
    for chat in ([], ["--chat"]):
        calls.clear()
        assert main(["generate", "--model", str(path), "--backend", "cpu", "--max-tokens", "2", "--quiet", *chat,
                     "hello world"]) == 0
        assert len(calls) == 1, chat


def test_options_are_named_in_full_or_by_their_short_form(tmp_path, monkeypatch, capsys):
    """No prefix matching (`--prompt x` is not `--prompt-file x`, `--temperature` is not `--temp`); the
    short options llama.cpp and mlx-lm users type (-m, -p, -n, -t); `--system` renders a chat;
    `--stop "\\n"` is a newline; `mlxinfer` alone prints the help."""
    from mlxinfer import cli
    from mlxinfer.synthetic import write_synthetic_model

    path = str(write_synthetic_model(tmp_path / "m.gguf", arch="qwen3", n_layers=1, vocab_size=320))  # ChatML
    seen = []
    monkeypatch.setattr(cli, "load", lambda *a, **k: seen.append(k) or mlxinfer_load(*a, **k))
    assert cli.main(["generate", "-m", path, "--backend", "cpu", "-t", "1", "-n", "3", "--quiet",
                     "-p", "hello"]) == 0
    assert seen[-1]["threads"] == 1
    capsys.readouterr()
    for argv, fragment in ((["generate", "--backend", "cpu", "--prompt-f", "x"], "unrecognized arguments"),
                           (["generate", "--backend", "cpu", "--temperature", "0.5", "hi"], "unrecognized arguments"),
                           (["generate", "-p", "a", "b"], "give the prompt once")):
        with pytest.raises(SystemExit) if "unrecognized" in fragment else contextlib.nullcontext():
            rc = cli.main(argv + (["-m", path] if "once" in fragment else []))
            assert rc == 1
        assert fragment in capsys.readouterr().err, argv
    assert cli.unescape(r"a\nb\t\\c\"\'") == "a\nb\t\\c\"'" and cli.unescape(r"\x41\q") == r"\x41\q"
    assert cli.build_parser().parse_args(["generate", "--stop", r"\n", "x"]).stop == ["\n"]
    encoded = []
    real = mlxinfer.Engine.encode_prompt
    monkeypatch.setattr(mlxinfer.Engine, "encode_prompt", lambda self, *a, **k: encoded.append(k) or real(self, *a, **k))
    assert cli.main(["generate", "-m", path, "--backend", "cpu", "-n", "2", "--quiet", "--system", "Be brief.",
                     "hi"]) == 0
    assert encoded[0] == dict(chat=True, system="Be brief.")
    assert cli.main([]) == 0 and "usage: mlxinfer" in capsys.readouterr().out


def test_threads_above_the_free_cores_are_warned_of(tmp_path, monkeypatch, capsys):
    """--threads past the cores not already busy: one warning line (time to first token went from 58 ms
    to 20-33 s on a busy machine without a word), and the run goes on; none within the free cores."""
    from mlxinfer import cli
    from mlxinfer.synthetic import write_synthetic_model

    path = str(write_synthetic_model(tmp_path / "m.gguf", arch="qwen3", n_layers=1, vocab_size=320))
    monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count() or 1), 0.0, 0.0))  # every core busy
    assert cli.main(["generate", "-m", path, "--backend", "cpu", "-t", "2", "-n", "2", "--quiet", "hi"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("mlxinfer: warning: --threads 2 is more than the 1 cores free")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert cli.main(["generate", "-m", path, "--backend", "cpu", "-t", "1", "-n", "2", "--quiet", "hi"]) == 0
    assert capsys.readouterr().err == ""
    import mlxinfer

    assert len(repr(mlxinfer.load(path, backend="cpu").tokenizer)) < 300  # its summary, not the vocabulary


def _shared(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("backend,kv", [("cpu", "prealloc"), ("cpu", "basic"), ("cpu", "paged"), ("mlx", "prealloc")])
def test_chat_turns_prefill_only_what_they_add(smollm2_path, backend, kv):
    """A conversation's turn 2 prefills only the tokens its rendered history adds to turn 1's prompt and
    reply (counted as the rows the model is given; with --kv paged, also the partial block before them),
    and says what a cold run of the whole history says, token for token."""
    engine = mlxinfer_load(smollm2_path, backend=backend, kv=kv, device="cpu" if backend == "mlx" else None)
    conv = engine.conversation()
    rows = []
    model = conv.loop.model

    def counting(ops, ids, batch, cache):
        rows.append(sum(batch.lengths))
        return model(ops, ids, batch, cache)

    conv.loop.model = counting
    history = [{"role": "user", "content": "What is the capital of France?"}]
    ids1 = engine.encode_prompt(history)
    events = list(conv.stream(ids1, max_tokens=8))
    first = events[-1].generation
    assert rows[0] == len(ids1) == conv.prefilled  # turn 1: all of it
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
    ids2 = engine.encode_prompt(history)
    # the template renders turn 1 as it was (prompt and reply tokens) at the start of turn 2's prompt
    assert _shared(ids1 + first.token_ids, ids2) == len(ids1) + len(first.token_ids)
    # held: the prompt and every reply token fed back (the last one is not when the reply ran to its length)
    held = len(ids1) + len(first.token_ids) - (first.finish_reason == "length")
    new = len(ids2) - held
    del rows[:]
    second = [e for e in conv.stream(ids2, max_tokens=8)][-1].generation
    if kv == "paged":  # whole blocks: the partial block before the new tokens is prefilled again
        new = len(ids2) - held // 16 * 16
    assert rows[0] == new == conv.prefilled and new < len(ids2) // 2
    assert all(r == 1 for r in rows[1:])  # then one decode row per token (on MLX the compiled step's, uncounted)
    cold = engine.generate(ids2, max_tokens=8)
    assert second.token_ids == cold.token_ids and second.text == cold.text
    # a prompt that does not continue the history (as from a template that rewrites earlier turns): all
    # but the start it shares (the template's system part) is prefilled
    del rows[:]
    other = engine.encode_prompt([{"role": "user", "content": "Name a colour."}])
    third = [e for e in conv.stream(other, max_tokens=4)][-1].generation
    shared = _shared(other, ids2) // 16 * 16 if kv == "paged" else _shared(other, ids2)
    assert rows[0] == conv.prefilled == len(other) - shared
    assert third.token_ids == engine.generate(other, max_tokens=4).token_ids
    # the same prompt again (the cache holds all of it): its last token is prefilled for its logits
    del rows[:]
    again = [e for e in conv.stream(other, max_tokens=4)][-1].generation
    assert rows[0] == conv.prefilled == (1 if kv != "paged" else len(other) - (len(other) - 1) // 16 * 16)
    assert again.token_ids == third.token_ids
    conv.reset()
    assert conv.loop.cache.in_use == 0


def test_messages_start_on_a_new_line_after_the_text(tmp_path, monkeypatch, capsys):
    """Ctrl-C and trace messages on stderr begin on a line of their own when the text stopped inside a
    line (a terminal shows both streams on one screen); after a finished line, no empty line."""
    from mlxinfer import cli
    from mlxinfer.engine import Engine
    from mlxinfer.synthetic import write_synthetic_model

    path = str(write_synthetic_model(tmp_path / "m.gguf", arch="qwen3", n_layers=1, vocab_size=320))

    def interrupted(self, prompt, on_text=None, **options):
        on_text("some text")
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    assert cli.main(["generate", "-m", path, "--backend", "cpu", "hi"]) == 130
    out = capsys.readouterr()
    assert out.out == "some text" and out.err == "\nmlxinfer: interrupted\n"
    monkeypatch.undo()
    assert cli.main(["generate", "-m", path, "--backend", "cpu", "-n", "3", "--trace", "--raw", "hi"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("[")  # the first pass's histogram comes before any text: no line to end
    cli._out("abc")
    cli._Messages().write("[trace]")
    cli._out("def\n")
    cli._Messages().write("[trace]")
    assert capsys.readouterr().err == "\n[trace][trace]"


def test_chat_commands_are_answered_here(tmp_path):
    """/help and unknown /commands are answered by the chat loop, never sent to the model; // sends a /."""
    from mlxinfer.cli import CHAT_HELP, run_chat
    from mlxinfer.synthetic import write_synthetic_model

    engine = mlxinfer_load(write_synthetic_model(tmp_path / "m.gguf", arch="qwen3", n_layers=1, vocab_size=320),
                           backend="cpu")
    sent, writes = [], []
    original = engine.encode_prompt
    engine.encode_prompt = lambda prompt, **kw: sent.append([m["content"] for m in prompt]) or original(prompt, **kw)
    lines = iter(["/help", "/save x", "//etc/hosts", "/exit", "never read"])
    run_chat(engine, lambda prompt: next(lines), writes.append, max_tokens=2)
    assert writes[0] == CHAT_HELP and "/reset" in CHAT_HELP
    assert writes[1].startswith("unknown command /save")
    assert sent == [["/etc/hosts"]]  # the one line the model saw
    assert next(lines) == "never read"  # /exit left


def test_serve_keeps_prefill_chunks_of_512_unless_told(monkeypatch):
    """`serve` asks for chunks of 512 where the backend would take 2,048 (16-bit on CUDA): running streams
    wait for one pass of at most that many rows, and a GPU reuses shared prefixes in whole chunks; the
    other commands leave it to the backend; --prefill-chunk decides everywhere."""
    from mlxinfer import cli

    seen = []
    monkeypatch.setattr(cli, "load", lambda *a, **k: seen.append(k["prefill_chunk"]))
    for argv, want in ((["serve"], 512), (["generate", "hi"], None), (["chat"], None),
                       (["serve", "--prefill-chunk", "2048"], 2048), (["generate", "--prefill-chunk", "64", "hi"], 64)):
        cli._load(cli.build_parser().parse_args(argv + ["--backend", "cpu"]))
        assert seen[-1] == want, argv


def test_the_synthetic_writer_refuses_rows_its_type_cannot_hold(tmp_path, capsys):
    """`python -m mlxinfer.synthetic`: a type whose blocks the rows do not fill (K-quants: 256 values), a
    mix of them, or no such type is one error line naming it (argparse's exit 2), and nothing is written;
    whole blocks write the file."""
    from mlxinfer import synthetic

    out = tmp_path / "m.gguf"
    for argv, fragment in ((["--type", "Q4_K", "--hidden", "128"], "--type Q4_K stores rows in blocks of 256 values: "
                                                                     "rows of 128 values"),
                           (["--type", "Q4_K_M", "--random-blocks"], "--type Q4_K_M stores rows in blocks of 256"),
                           (["--type", "Q9"], "--type Q9 is not a GGML type"),
                           (["--type", "Q4_K", "--hidden", "256", "--ffn", "512", "--heads", "2", "--head-dim", "128"],
                            "--type Q4_K: gguf-py does not quantize it; write its blocks with --random-blocks")):
        with pytest.raises(SystemExit) as e:
            synthetic.main([str(out), *argv])
        assert e.value.code == 2 and fragment in capsys.readouterr().err and not out.exists(), argv
    synthetic.main([str(out), "--type", "Q4_K", "--random-blocks", "--hidden", "256", "--ffn", "512", "--heads", "2", "--kv-heads", "1",
                    "--head-dim", "128", "--vocab", "300"])
    assert out.exists()


def test_inspect_without_a_file_describes_the_default_model(smollm2_path, capsys):
    from mlxinfer import cli

    assert cli.main(["inspect"]) == 0
    assert capsys.readouterr().out.startswith(f"file: {smollm2_path}\n")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_a_nan_scale_or_value_in_the_file_is_a_one_line_error(tmp_path, qtype):
    """A corrupt file: one block of a quantized matrix with a NaN scale (Q4_K's dmin, Q6_K's d), or an F32
    norm weight with an inf, is refused at load by both backends, and under --tp before any rank starts,
    in one line naming the tensor, its type and the block's row (`GGUFFile.check_finite`), never logits
    of NaN."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from mlxinfer.gguf_file import GGUFFile
    from mlxinfer.synthetic import write_synthetic_model

    p = write_synthetic_model(tmp_path / f"{qtype}.gguf", arch="llama", n_layers=1, hidden=512, ffn=512, n_heads=8,
                              n_kv_heads=2, head_dim=64, qtype=qtype, random_blocks=True)  # (cut in whole blocks over 2 ranks)
    name, norm = "blk.0.ffn_up.weight", "blk.0.ffn_norm.weight"
    with GGUFFile(p) as g:
        t, n = g.tensor(name), g.tensor(norm)
        assert t.type_name == qtype and n.type_name == "F32" and t.shape[1] == 512  # (2 blocks a row)
        size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
        at = t.offset + 7 * size + (2 if qtype == "Q4_K" else 208)  # row 3's block 1: its dmin (Q4_K) or d (Q6_K)
        norm_at = n.offset + 4 * 17
    data = bytearray(open(p, "rb").read())
    good = bytes(data)
    struct.pack_into("<H", data, at, 0x7E00)  # NaN
    bad = tmp_path / "nan-scale.gguf"
    bad.write_bytes(bytes(data))
    data = bytearray(good)
    struct.pack_into("<f", data, norm_at, float("inf"))
    bad_norm = tmp_path / "inf-norm.gguf"
    bad_norm.write_bytes(bytes(data))
    for backend, tp in (("cpu", []), ("mlx", []), ("mlx", ["--tp", "2"])):
        args = ["--backend", backend, *tp, "--device", "cpu", "--max-tokens", "2", "hi"]
        assert_one_line_error(run_cli("generate", "--model", str(bad), *args),
                              f"tensor '{name}' ({qtype}) has an inf or NaN scale: block 1 of row 3")
        assert_one_line_error(run_cli("generate", "--model", str(bad_norm), *args),
                              f"tensor '{norm}' (F32) has an inf or NaN value: value 17")
