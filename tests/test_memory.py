"""Memory and precision options: what runs on a CPU is trained end to end; what needs CUDA is refused on it."""

import hashlib
import http.server
import io
import json
import threading

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import base_args, launch

pytestmark = pytest.mark.slow  # every test here runs the script: not in `make test-fast`

LORA = "pytorch_lora_weights.safetensors"

# refusals that only a machine without CUDA gives: skipped, not failed, where torch sees a GPU
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="refused only without CUDA")


def _lora(out, name=LORA):
    return load_file(str(out / name))


@pytest.fixture(scope="module")
def plain_run(tiny_model, tmp_path_factory):
    """The reference: 3 steps, no memory option."""
    from tests.tiny_flux2 import make_images

    root = tmp_path_factory.mktemp("plain")
    make_images(str(root / "images"))
    launch(base_args(tiny_model, root / "images", root / "out", "--max_train_steps", "3"))
    return root


@pytest.mark.parametrize("flag", ["--gradient_checkpointing", "--offload"])
def test_memory_option_trains_the_same_lora(flag, tiny_model, plain_run, tmp_path):
    out = tmp_path / "out"
    launch(base_args(tiny_model, plain_run / "images", out, "--max_train_steps", "3", flag))
    reference, ours = _lora(plain_run / "out"), _lora(out)
    assert all(torch.allclose(ours[k], reference[k], rtol=1e-5, atol=1e-7) for k in reference)  # recompute/move only


def test_bf16_mixed_precision_keeps_lora_float32_and_saves_as_asked(tiny_model, images, tmp_path):
    out = tmp_path / "out"
    launch(base_args(tiny_model, images, out, "--max_train_steps", "2", "--checkpointing_steps", "2",
                     "--mixed_precision", "bf16"))
    assert {v.dtype for v in _lora(out / "checkpoint-2").values()} == {torch.float32}  # the trained parameters
    assert {v.dtype for v in _lora(out).values()} == {torch.bfloat16}  # the final file, in the training dtype...
    upcast = tmp_path / "upcast"
    launch(base_args(tiny_model, images, upcast, "--max_train_steps", "2", "--mixed_precision", "bf16",
                     "--upcast_before_saving"))
    assert {v.dtype for v in _lora(upcast).values()} == {torch.float32}  # ...or float32 with --upcast_before_saving


def test_8bit_adam_trains_and_resumes_exactly(tiny_model, images, tmp_path):
    common = ["--use_8bit_adam", "--max_train_steps", "4", "--checkpointing_steps", "2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch(base_args(tiny_model, images, straight, *common))
    # resumed by path into another output folder (the straight run's own folder resumes with `latest` elsewhere)
    launch(base_args(tiny_model, images, resumed, *common, "--resume_from_checkpoint", straight / "checkpoint-2"))
    a, b = _lora(straight), _lora(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads((straight / "checkpoint-2" / "training.json").read_text())
    assert "__bnb_optimizer_quant_state__" in json.dumps(state)  # bitsandbytes state, as safetensors + JSON


@pytest.mark.parametrize("extra, message", [
    pytest.param(["--do_fp8_training"], "--do_fp8_training needs a CUDA GPU of compute capability 8.9", marks=NO_CUDA),
    pytest.param(["--bnb_quantization_config_path", "nf4.json"], "--bnb_quantization_config_path needs a CUDA GPU",
                 marks=NO_CUDA),
    (["--bnb_quantization_config_path", "broken.json"], "broken.json: Expecting"),
    (["--bnb_quantization_config_path", "empty.json"], "expected a JSON object with load_in_4bit or load_in_8bit"),
    (["--remote_text_encoder", "--hub_token", "x", "--pretrained_model_name_or_path", "KLEIN"], "serves FLUX.2 [dev] embeddings only"),
    (["--fsdp_text_encoder"], "--fsdp_text_encoder shards the text encoder over several processes"),
])
def test_cuda_only_and_invalid_memory_options_are_refused_before_loading(extra, message, tiny_model, images, tmp_path):
    from tests.tiny_flux2 import build_tiny_flux2_klein

    (tmp_path / "nf4.json").write_text(json.dumps({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}))
    (tmp_path / "broken.json").write_text("{load_in_4bit: yes")
    (tmp_path / "empty.json").write_text("{}")
    if "KLEIN" in extra:
        extra[extra.index("KLEIN")] = build_tiny_flux2_klein(str(tmp_path / "klein"))
    extra = [str(tmp_path / e) if e.endswith(".json") else e for e in extra]
    proc = launch(base_args(tiny_model, images, tmp_path / "out", *extra), check=False, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------- remote encoder


class StubEncoder(http.server.BaseHTTPRequestHandler):
    """127.0.0.1 stand-in for the remote text encoder: answers torch.save(tensor) like the real one."""

    mode, requests = "ok", []

    def do_POST(self):  # noqa: N802 - http.server's naming
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        type(self).requests.append((prompt, self.headers["Authorization"]))
        if self.mode == "unavailable":
            self.send_error(503, "Service Unavailable")
            return
        buffer = io.BytesIO()
        if self.mode == "hostile":
            buffer.write(_hostile_payload())
        else:
            seed = int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16)
            torch.save(torch.randn(1, 64, 32, generator=torch.Generator().manual_seed(seed)), buffer)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(buffer.getvalue())

    def log_message(self, *args):
        pass


class _Pwn:
    """A payload that runs a shell command when unpickled by anything less careful than weights_only=True."""

    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/flux2-remote-pwned",))


def _hostile_payload():
    buffer = io.BytesIO()
    torch.save(_Pwn(), buffer)  # torch's container around a pickle of _Pwn
    return buffer.getvalue()


@pytest.fixture
def stub_encoder():
    server = http.server.HTTPServer(("127.0.0.1", 0), StubEncoder)
    StubEncoder.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/predict"
    server.shutdown()


def _remote(tiny_model, images, out, url):
    """The script with the remote text encoder at `url` (forked from the zygote: the stub answers over TCP)."""
    return launch(base_args(tiny_model, images, out, "--max_train_steps", "2", "--remote_text_encoder",
                            "--remote_text_encoder_url", url, "--hub_token", "hf_stub_token"), check=False, timeout=300)


def test_remote_text_encoder_replaces_the_local_one(stub_encoder, tiny_model, images, tmp_path):
    StubEncoder.mode = "ok"
    proc = _remote(tiny_model, images, tmp_path / "out", stub_encoder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loading the text encoder" not in proc.stderr and (tmp_path / "out" / LORA).is_file()
    prompts = sorted(p for p, _ in StubEncoder.requests)
    assert len(prompts) == len(set(prompts)) == 6  # each unique caption once
    assert {auth for _, auth in StubEncoder.requests} == {"Bearer hf_stub_token"}


@pytest.mark.parametrize("mode, message", [("unavailable", "answered HTTP 503"), ("hostile", "did not send a tensor")])
def test_remote_text_encoder_errors_are_named_and_nothing_is_unpickled(mode, message, stub_encoder, tiny_model, images, tmp_path):
    import os

    StubEncoder.mode = mode
    if os.path.exists("/tmp/flux2-remote-pwned"):
        os.remove("/tmp/flux2-remote-pwned")
    proc = _remote(tiny_model, images, tmp_path / "out", stub_encoder)
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not os.path.exists("/tmp/flux2-remote-pwned")  # the payload's code never ran
