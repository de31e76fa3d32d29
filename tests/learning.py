"""Does a run learn its subject? Train the real script on one synthetic subject image, then sample with diffusers'
own Flux2Pipeline, with and without the saved LoRA, and measure how far the final latents are from the subject's.

Used by tests/test_learning.py and by `make demo`:

    python tests/learning.py OUT_DIR [trainer flags...]   # builds the tiny model and the subject, trains, prints

Edit (image-to-image) training has its own figure (tests/test_edit_learning.py): pairs of a scene and the same scene
relit, the real script trained with --cond_data_dir, Flux2Pipeline sampled in edit mode (image=[condition]) with and
without the LoRA, distances to the relit targets:

    python tests/learning.py --edit OUT_DIR [trainer flags...]

Preservation has its own world and figure (tests/test_preservation.py): a base model pretrained on two captioned
classes ("a photo of dog": draw_scene's discs, "a photo of cat": draw_cat's squares), a subject of one class trained
plain, with --with_prior_preservation and with --output_preservation; subject fidelity as above, and class drift,
the distance between the base model's and the LoRA's samples for the class prompt (same seeds):

    python tests/learning.py --preservation OUT_DIR [trainer flags...]

The three base models' trained VAEs and transformers are shipped in tests/data/learning (base_model() copies them, a
second instead of a minute each); after changing how they are built, regenerate them (about 3 CPU-minutes):

    python tests/learning.py --write-base-models

The distance is measured in the space the transformer denoises: the subject image VAE-encoded (posterior mean),
patchified, batch-norm normalised and packed into tokens, exactly as the pipeline holds its latents before decoding
(output_type="latent"). Everything here uses diffusers directly, never the trainer's helpers, so a bug in the
trainer cannot cancel out.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.tiny_flux2 import MAX_SEQUENCE_LENGTH, TEXT_ENCODER_OUT_LAYERS, build_tiny_flux2  # noqa: E402

PROMPT = "a photo of sks dog"
RESOLUTION = 32
SAMPLING_STEPS = 28
EDIT_RESOLUTION = 64  # the FLUX.2 pipelines refuse condition images under 64 px a side
EDIT_PROMPT = "relight it"
CLASS_PROMPTS = {"dog": "a photo of dog", "cat": "a photo of cat"}  # the two-class world's captions


def draw_scene(rng, size=RESOLUTION, sky=None, disc=None, bar=True):
    """A structured image (not noise): a disc, with a dark bar across it, on a vertical gradient. Unset colours and
    the disc's place are drawn from `rng`: the family of images the tiny base model is pretrained on."""
    sky = rng.uniform(20, 230, size=(2, 3)) if sky is None else np.asarray(sky, dtype=np.float32)
    cx, cy, radius, colour = disc if disc is not None else (*rng.uniform(0.3, 0.7, 2), rng.uniform(0.15, 0.3),
                                                             rng.uniform(0, 255, 3))
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / (size - 1)
    image = sky[0] + (sky[1] - sky[0]) * yy[..., None]
    inside = (xx - cx) ** 2 + (yy - cy) ** 2 < radius ** 2
    image[inside] = colour
    if bar:
        image[(np.abs(yy - cy) < 0.06) & inside] = (60, 30, 20)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8), "RGB")


def draw_cat(rng, size=RESOLUTION):
    """The second class of the two-class world, visibly not draw_scene's: a light square with a dark vertical
    stripe on a dark (night) gradient; colours, place and size drawn from `rng`."""
    sky = rng.uniform(0, 80, size=(2, 3))
    cx, cy, half, colour = *rng.uniform(0.3, 0.7, 2), rng.uniform(0.15, 0.25), rng.uniform(150, 255, 3)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / (size - 1)
    image = sky[0] + (sky[1] - sky[0]) * yy[..., None]
    inside = (np.abs(xx - cx) < half) & (np.abs(yy - cy) < half)
    image[inside] = colour
    image[(np.abs(xx - cx) < 0.06) & inside] = (20, 30, 60)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8), "RGB")


def make_subject(folder, size=RESOLUTION):
    """The one instance image: a warm disc on a sky-like gradient, a particular member of the family."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "subject.png"
    draw_scene(None, size, sky=((40, 90, 200), (100, 170, 140)), disc=(0.6, 0.45, 0.28, (235, 150, 40))).save(path)
    return path


def subject_latent(model, image_path):
    """[1, L, C]: the image as the pipeline's final latents would hold it."""
    from diffusers import AutoencoderKLFlux2

    with Image.open(image_path) as image:
        return encode(AutoencoderKLFlux2.from_pretrained(model, subfolder="vae"), [image])


def encode(vae, images, normalise=True):
    """PIL images -> [N, L, C] packed, batch-norm normalised latents (posterior means)."""
    from diffusers import Flux2Pipeline

    with torch.no_grad():
        latents = Flux2Pipeline._patchify_latents(vae.encode(pixels_of(images)).latent_dist.mean)
    if normalise:
        bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
        bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        latents = (latents - bn_mean) / bn_std
    return Flux2Pipeline._pack_latents(latents)


def build_base_model(path, vae_steps=300, steps=1000, batch_size=16, num_images=256, seed=0, size=RESOLUTION):
    """A tiny FLUX.2 [dev] that starts where a real checkpoint does, built with diffusers alone (independently of the
    trainer); returns `path`. The random fixture of tests/tiny_flux2.py cannot serve: its VAE reconstructs nothing
    (so decoded validation images are noise) and its transformer cannot denoise at all (a LoRA on it would have to
    learn denoising itself, and plateaus at 1.8x). So, on draw_scene's family of images:
    - the VAE (4 latent channels) is trained as an autoencoder, and its batch-norm statistics are set to its
      latents' (as the real VAE's are: latents come out about zero-mean, unit-variance);
    - the transformer is trained as a small generative model (rectified flow, one generic prompt), so it arrives
      knowing how to denoise and knowing the class, as a real checkpoint does.
    `size` is the images' side: 32 or 64; at 64 px the VAE has one more downsampling block, so the
    transformer sees 8x8 tokens at either size (64 px for edit training, whose condition images the pipelines refuse
    under 64 px: the 32 px model run at 64 px would see a 16x16 grid it never learned, and learns edits poorly)."""
    build_tiny_flux2(str(path))  # text encoder, tokenizer, scheduler and model_index.json
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    family = [draw_scene(rng, size) for _ in range(num_images)]
    return pretrain(path, family, "a photo", vae_steps, steps, batch_size, size)


def pretrain(path, images, prompts, vae_steps, steps, batch_size, size):
    """The VAE, then the transformer, of a tiny base model at `path` trained on `images` (PIL) captioned `prompts`
    (one prompt for all, or one per image); the torch seed set by the caller. Returns `path`."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    blocks = 1 + int(np.log2(size // 16))  # 2 at 32 px, 3 at 64 px: 8x8 tokens at either size
    vae = AutoencoderKLFlux2(sample_size=size, in_channels=3, out_channels=3, block_out_channels=(8, 16, 16)[:blocks],
                             down_block_types=("DownEncoderBlock2D",) * blocks,
                             up_block_types=("UpDecoderBlock2D",) * blocks, layers_per_block=1, latent_channels=4,
                             norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)
    train_autoencoder(vae, pixels_of(images), vae_steps, batch_size)
    raw = encode(vae, images, normalise=False)  # [N, L, C]
    vae.bn.running_mean.copy_(raw.mean((0, 1)))
    vae.bn.running_var.copy_(raw.var((0, 1)) - vae.config.batch_norm_eps)
    vae.save_pretrained(Path(path, "vae"))
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * 4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16 * len(TEXT_ENCODER_OUT_LAYERS), timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4],
        guidance_embeds=True)
    train_generator(path, transformer, encode(vae, images), steps, batch_size, prompts=prompts)
    transformer.save_pretrained(Path(path, "transformer"))
    return path


def draw_class(name, rng, size=RESOLUTION):
    """One image of the two-class world's class `name`: "dog" is draw_scene's family, "cat" draw_cat's."""
    return draw_scene(rng, size) if name == "dog" else draw_cat(rng, size)


def build_two_class_model(path, vae_steps=300, steps=1000, batch_size=16, num_images=256, seed=0, size=RESOLUTION):
    """build_base_model's tiny FLUX.2 [dev], pretrained on two captioned classes instead of one generic prompt:
    half the images draw_scene's discs captioned CLASS_PROMPTS["dog"], half draw_cat's squares captioned
    CLASS_PROMPTS["cat"] (interleaved), so the base model responds to the class word, as a real checkpoint does:
    its samples for "a photo of dog" are discs and for "a photo of cat" squares. Returns `path`."""
    build_tiny_flux2(str(path))
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    names = [("dog", "cat")[i % 2] for i in range(num_images)]
    images = [draw_class(name, rng, size) for name in names]
    return pretrain(path, images, [CLASS_PROMPTS[name] for name in names], vae_steps, steps, batch_size, size)


# ---------------------------------------------------------------------------------------------------------------
# The base models shipped as test data: tests/data/learning/<name>/ holds the vae/ and transformer/ that the builder
# above trains (about 2 minutes on two cores for the three), and build.json the digest of the builder's source and
# arguments they were trained by. base_model() copies them over build_tiny_flux2's folder when the digest matches, and
# builds as before (saying how to regenerate) when it does not; tests/test_learning.py fails while they are stale.

DATA = ROOT / "tests" / "data" / "learning"
REGENERATE = "python tests/learning.py --write-base-models"


def base_models():
    """{name: (builder, its keyword arguments)}: the three base models the learning tests use."""
    return {"tiny-flux2": (build_base_model, {}),  # tests/test_learning.py, `make demo`
            "tiny-flux2-64": (build_base_model, {"size": EDIT_RESOLUTION}),  # tests/test_edit_learning.py
            "tiny-flux2-two-class": (build_two_class_model, {})}  # tests/test_preservation.py


def builder_digest(name):
    """sha256 of everything in this repository that decides the trained weights of base model `name`: the source of
    the builders, pretraining and drawing functions, of the [dev] text encoder and tokenizer build_tiny_flux2 writes
    (train_generator's captions go through them), the constants they read, and the builder's arguments. The vae and
    transformer build_tiny_flux2 writes are replaced, so its TRANSFORMER and VAE configs do not count."""
    import hashlib
    import inspect
    import json

    from tests import tiny_flux2

    builder, kwargs = base_models()[name]
    functions = (build_base_model, build_two_class_model, pretrain, train_autoencoder, train_generator, encode,
                 pixels_of, draw_scene, draw_cat, draw_class, tiny_flux2.build_tiny_flux2, tiny_flux2.dev_text_config,
                 tiny_flux2.build_tokenizer, tiny_flux2._train_bpe, tiny_flux2._corpus)
    constants = (RESOLUTION, EDIT_RESOLUTION, CLASS_PROMPTS, TEXT_ENCODER_OUT_LAYERS, MAX_SEQUENCE_LENGTH,
                 tiny_flux2.TEXT_HIDDEN_SIZE, tiny_flux2.VOCAB_SIZE, tiny_flux2.SPECIAL_TOKENS,
                 tiny_flux2.CHAT_TEMPLATE, tiny_flux2._WORDS, tiny_flux2.IMAGE_SPECS)
    text = json.dumps({"builder": builder.__name__, "kwargs": kwargs, "constants": [repr(c) for c in constants],
                       "sources": [inspect.getsource(f) for f in functions]}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def shipped_digest(name):
    """The digest build.json records beside the shipped weights of `name`, or None if there are none."""
    import json

    record = DATA / name / "build.json"
    return json.loads(record.read_text())["digest"] if record.is_file() else None


def base_model(name, path):
    """Base model `name` (base_models()) at `path`; returns `path`. build_tiny_flux2's folder with the shipped vae/ and
    transformer/ copied in, a second or two, when they were trained by the current builder (builder_digest);
    otherwise built as before (about 35 to 55 s on two cores), with a warning naming the command that regenerates
    them."""
    import shutil
    import warnings

    builder, kwargs = base_models()[name]
    if shipped_digest(name) != builder_digest(name):
        warnings.warn(f"tests/data/learning/{name} is missing or was trained by another builder: building it (about "
                      f"a minute); regenerate the shipped base models with `{REGENERATE}`", stacklevel=2)
        return builder(path, **kwargs)
    build_tiny_flux2(str(path))  # text encoder, tokenizer, scheduler and model_index.json
    for part in ("vae", "transformer"):
        shutil.rmtree(Path(path, part))
        shutil.copytree(DATA / name / part, Path(path, part))
    return path


def write_base_models(names=None):
    """`python tests/learning.py --write-base-models [NAME...]`: train the base models (all, or those named) with one
    math thread, as each `make test` worker does, and write their vae/, transformer/ and build.json under DATA."""
    import json
    import shutil
    import tempfile
    import time

    import diffusers
    import transformers

    torch.set_num_threads(1)
    for name in names or base_models():
        builder, kwargs = base_models()[name]
        with tempfile.TemporaryDirectory() as tmp:
            start = time.monotonic()
            builder(Path(tmp, name), **kwargs)
            seconds = time.monotonic() - start
            target = DATA / name
            shutil.rmtree(target, ignore_errors=True)
            for part in ("vae", "transformer"):
                shutil.copytree(Path(tmp, name, part), target / part)
        record = {"digest": builder_digest(name), "builder": builder.__name__, "kwargs": kwargs,
                  "regenerate": REGENERATE,
                  "trained_with": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                                   "transformers": transformers.__version__, "threads": torch.get_num_threads()}}
        (target / "build.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
        print(f"{name}: built in {seconds:.0f} s, {size / 1e6:.2f} MB in {target}", flush=True)


def pixels_of(images):
    """PIL images -> [N, 3, H, W] in [-1, 1]."""
    return torch.stack([torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
                        for im in images])


def train_autoencoder(vae, pixels, steps, batch_size, lr=3e-3):
    optimizer = torch.optim.Adam(vae.parameters(), lr=lr)
    for _ in range(steps):
        x = pixels[torch.randint(0, len(pixels), (batch_size,))]
        posterior = vae.encode(x).latent_dist
        loss = (vae.decode(posterior.sample()).sample - x).pow(2).mean() + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    vae.eval()


def train_generator(path, transformer, data, steps, batch_size, lr=2e-3, prompts="a photo"):
    """Rectified flow on `data` [N, L, C] (packed latents), guidance drawn in [1, 5], captioned `prompts`: one prompt
    for every image ("a photo"), or a list of one per image (each sample then trained with its own image's)."""
    from diffusers import Flux2Pipeline
    from transformers import AutoTokenizer

    pipe = Flux2Pipeline.from_pretrained(path, tokenizer=None, vae=None, transformer=None)
    pipe.tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
    per_image = not isinstance(prompts, str)
    captions = sorted(set(prompts)) if per_image else [prompts]
    with torch.no_grad():
        encoded = [pipe.encode_prompt(c, device="cpu", max_sequence_length=MAX_SEQUENCE_LENGTH,
                                      text_encoder_out_layers=TEXT_ENCODER_OUT_LAYERS) for c in captions]
    embeds, text_ids = encoded[0]  # the text ids are positions: the same for every caption
    if per_image:
        table = torch.cat([e for e, _ in encoded])  # [P, S, D]
        caption_of = torch.tensor([captions.index(p) for p in prompts])  # image -> row of table
        assert len(caption_of) == len(data), (len(caption_of), len(data))
    side = int(data.shape[1] ** 0.5)
    img_ids = Flux2Pipeline._prepare_latent_ids(torch.zeros(1, 1, side, side))
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        chosen = torch.randint(0, len(data), (batch_size,))
        x0 = data[chosen]
        noise = torch.randn_like(x0)
        sigma = torch.rand(batch_size)
        s = sigma.view(-1, 1, 1)
        captions_in = table[caption_of[chosen]] if per_image else embeds.expand(batch_size, -1, -1)
        pred = transformer(hidden_states=(1 - s) * x0 + s * noise, timestep=sigma,
                           guidance=torch.empty(batch_size).uniform_(1, 5), encoder_hidden_states=captions_in,
                           txt_ids=text_ids.expand(batch_size, -1, -1), img_ids=img_ids.expand(batch_size, -1, -1),
                           return_dict=False)[0]
        loss = (pred - (noise - x0)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def pipeline_and_embeds(model, lora_dir, prompt):
    """diffusers' own Flux2Pipeline of `model` (with the LoRA of `lora_dir`, if any) and its embedding of `prompt`."""
    from diffusers import Flux2Pipeline
    from transformers import AutoTokenizer

    pipe = Flux2Pipeline.from_pretrained(model, tokenizer=None)
    pipe.tokenizer = AutoTokenizer.from_pretrained(model, subfolder="tokenizer")
    pipe.set_progress_bar_config(disable=True)
    if lora_dir is not None:
        pipe.load_lora_weights(str(lora_dir))
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(prompt, device="cpu", max_sequence_length=MAX_SEQUENCE_LENGTH,
                                       text_encoder_out_layers=TEXT_ENCODER_OUT_LAYERS)
    return pipe, embeds


def final_latents(model, lora_dir=None, seeds=range(4), steps=SAMPLING_STEPS, prompt=PROMPT):
    """[len(seeds), L, C]: Flux2Pipeline's final latents for `prompt`, base model or with the LoRA of `lora_dir`."""
    pipe, embeds = pipeline_and_embeds(model, lora_dir, prompt)
    return sampled_latents(pipe, embeds, seeds, steps)


def sampled_latents(pipe, embeds, seeds, steps):
    """[len(seeds), L, C]: `pipe`'s final latents for the prompt embedding `embeds`, one seed per sample."""
    with torch.no_grad():
        return torch.cat([pipe(prompt_embeds=embeds, height=RESOLUTION, width=RESOLUTION, num_inference_steps=steps,
                               output_type="latent", generator=torch.Generator().manual_seed(s)).images
                          for s in seeds])


def latents_by_prompt(model, prompts, lora_dir=None, seeds=range(4), steps=SAMPLING_STEPS):
    """{prompt: final_latents(model, lora_dir, seeds, steps, prompt)} for each of `prompts`, with one pipeline."""
    pipe, _ = pipeline_and_embeds(model, lora_dir, prompts[0])
    result = {}
    for prompt in prompts:
        with torch.no_grad():
            embeds, _ = pipe.encode_prompt(prompt, device="cpu", max_sequence_length=MAX_SEQUENCE_LENGTH,
                                           text_encoder_out_layers=TEXT_ENCODER_OUT_LAYERS)
        result[prompt] = sampled_latents(pipe, embeds, seeds, steps)
    return result


def distance(latents, subject):
    """Root mean square distance of each sample's latents to the subject's, averaged over samples."""
    return (latents - subject).pow(2).flatten(1).mean(1).sqrt().mean().item()


# A quiet run's launcher: None runs `python SCRIPT FLAGS` (`make demo`); the learning tests set conftest.launch's
# (same command and environment, the script's libraries already imported: a few seconds less per run), which takes the
# flags and returns the finished process without raising.
QUIET_LAUNCH = None


def train(model, images, output_dir, *flags, steps=1000, quiet=True, resolution=RESOLUTION, prompt=PROMPT,
          learning_rate="3e-3", rank=8):
    """The real script on the subject with the default LoRA targets (under `accelerate launch` unless quiet, as a
    user runs it); returns the finished process."""
    launcher = [] if quiet else ["-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
                                 "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd = [sys.executable, *launcher, str(ROOT / "train_dreambooth_lora_flux2.py"),
           "--pretrained_model_name_or_path", str(model), "--instance_data_dir", str(images),
           "--instance_prompt", prompt, "--output_dir", str(output_dir), "--resolution", str(resolution),
           "--repeats", "4", "--train_batch_size", "4", "--max_train_steps", str(steps),
           "--learning_rate", str(learning_rate),
           "--rank", str(rank), "--lora_alpha", str(2 * rank), "--cache_latents",
           "--text_encoder_out_layers", *map(str, TEXT_ENCODER_OUT_LAYERS),
           "--max_sequence_length", str(MAX_SEQUENCE_LENGTH), "--seed", "0", "--report_to", "none",
           "--checkpointing_steps", str(10 * steps), "--precompute_cache_dir", "none", *map(str, flags)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if quiet and QUIET_LAUNCH is not None:  # the tests: conftest.launch (forked from its zygote, no fresh import)
        proc = QUIET_LAUNCH(cmd[2:])
    else:
        proc = subprocess.run(cmd, env=env, capture_output=quiet, text=True)
    if proc.returncode:
        raise RuntimeError(f"training failed ({proc.returncode}):\n{(proc.stderr or '')[-4000:]}")
    return proc


def learning_figure(model, images, output_dir, *flags, steps=1000, quiet=True):
    """Train, then -> (base distance, LoRA distance) to the subject."""
    train(model, images, output_dir, *flags, steps=steps, quiet=quiet)
    subject = subject_latent(model, next(Path(images).glob("*.png")))
    return distance(final_latents(model), subject), distance(final_latents(model, output_dir), subject)


# ---------------------------------------------------------------------------------------------------------------
# Preservation: does the class keep its look?

SUBJECT_PROMPT = "a photo of sks"  # the preservation runs' instance prompt: --output_preservation's sks -> dog
PRESERVATION_MODES = ("plain", "prior", "output")  # plain, --with_prior_preservation, --output_preservation
PRESERVATION_STEPS, PRESERVATION_LR, PRESERVATION_RANK = 1000, "6e-3", 16  # the same for every mode
NUM_CLASS_IMAGES = 8


def preservation_flags(mode, class_dir, num_class_images=NUM_CLASS_IMAGES):
    """The trainer flags of a preservation mode; prior preservation's class images are generated by the script
    itself (the base model, CLASS_PROMPTS["dog"]) into `class_dir`."""
    return {"plain": [],
            "prior": ["--with_prior_preservation", "--class_prompt", CLASS_PROMPTS["dog"], "--class_data_dir",
                      class_dir, "--num_class_images", num_class_images, "--prior_loss_weight", 1.0],
            "output": ["--trigger_word", "sks", "--output_preservation", "--class_word", "dog",
                       "--output_preservation_weight", 1.0]}[mode]


def class_references(model, count=128, seed=12345):
    """{class name: [count, L, C]} latents of fresh images of each class of the two-class world (not the
    pretraining images: another seed)."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2.from_pretrained(model, subfolder="vae")
    rng = np.random.default_rng(seed)
    return {name: encode(vae, [draw_class(name, rng) for _ in range(count)]) for name in CLASS_PROMPTS}


def rms_distances(latents, references):
    """[N, M]: the RMS latent distance of each of `latents` [N, L, C] to each of `references` [M, L, C]."""
    return (latents[:, None] - references[None]).pow(2).flatten(2).mean(2).sqrt()


def class_response(model, seeds=range(16), steps=SAMPLING_STEPS):
    """Does the base model respond to the class word? Its samples for each class prompt against fresh images of
    both classes (class_references) -> {class of the prompt: {"dog"/"cat": mean distance of the samples to the
    nearest image of that class, "recognised": the share of samples whose nearest image, of both classes pooled,
    is of the prompt's class}}: a nearest-neighbour classifier. A model deaf to the class word (the same samples for
    both prompts) has shares summing to 1, at most one of them above 0.5."""
    references = class_references(model)
    names = list(references)
    pooled = torch.cat([references[n] for n in names])
    labels = [n for n in names for _ in range(len(references[n]))]
    latents = latents_by_prompt(model, list(CLASS_PROMPTS.values()), seeds=seeds, steps=steps)
    response = {}
    for name, prompt in CLASS_PROMPTS.items():
        nearest = rms_distances(latents[prompt], pooled).argmin(1).tolist()
        response[name] = {**{ref: rms_distances(latents[prompt], references[ref]).min(1).values.mean().item()
                             for ref in names},
                          "recognised": sum(labels[i] == name for i in nearest) / len(nearest)}
    return response


def preservation_figure(model, output_dir, *flags, modes=PRESERVATION_MODES, steps=PRESERVATION_STEPS, seeds=range(4),
                        mode_flags=preservation_flags, quiet=True):
    """The subject (make_subject: a particular dog) trained with the instance prompt SUBJECT_PROMPT once per mode
    (the same steps, seed and learning rate), then sampled with diffusers' Flux2Pipeline, base and LoRA, the same
    seeds -> {"base": {"fidelity": the base model's distance to the subject, "dog to subject": that of its samples
    for CLASS_PROMPTS["dog"]}, mode: {"fidelity": the LoRA's distance to the subject, "drift": distance of the
    LoRA's samples for CLASS_PROMPTS["dog"] to the base model's (same seeds), "cat drift": the same for
    CLASS_PROMPTS["cat"], "dog to subject": the LoRA's dog samples' distance to the subject, "seconds": the
    training run's wall time}}. The runs' output folders are `output_dir`/<mode>."""
    import time

    output_dir = Path(output_dir)
    images = output_dir / "subject"
    make_subject(images)
    subject = subject_latent(model, images / "subject.png")
    prompts = [SUBJECT_PROMPT, CLASS_PROMPTS["dog"], CLASS_PROMPTS["cat"]]
    base = latents_by_prompt(model, prompts, seeds=seeds)
    table = {"base": {"fidelity": distance(base[SUBJECT_PROMPT], subject),
                      "dog to subject": distance(base[CLASS_PROMPTS["dog"]], subject)}}
    for mode in modes:
        start = time.monotonic()
        lora_dir = output_dir / mode
        train(model, images, lora_dir, *mode_flags(mode, output_dir / f"{mode}-class-images"), *flags, steps=steps,
              prompt=SUBJECT_PROMPT, learning_rate=PRESERVATION_LR, rank=PRESERVATION_RANK, quiet=quiet)
        seconds = time.monotonic() - start
        lora = latents_by_prompt(model, prompts, lora_dir, seeds=seeds)
        table[mode] = {"fidelity": distance(lora[SUBJECT_PROMPT], subject),
                       "drift": distance(lora[CLASS_PROMPTS["dog"]], base[CLASS_PROMPTS["dog"]]),
                       "cat drift": distance(lora[CLASS_PROMPTS["cat"]], base[CLASS_PROMPTS["cat"]]),
                       "dog to subject": distance(lora[CLASS_PROMPTS["dog"]], subject), "seconds": seconds}
    return table


def format_preservation_table(table):
    """The figure as a Markdown table (the README's)."""
    base = table["base"]["fidelity"]
    names = {"plain": "plain", "prior": "`--with_prior_preservation`", "output": "`--output_preservation`"}
    lines = ["| training | subject distance (base {:.3f}) | class drift, dog | class drift, cat | dog samples to "
             "the subject (base {:.3f}) |".format(base, table["base"]["dog to subject"]),
             "|---|---|---|---|---|"]
    for mode, row in table.items():
        if mode != "base":
            lines.append(f"| {names.get(mode, mode)} | {row['fidelity']:.3f} ({row['fidelity'] / base:.2f}x) | "
                         f"{row['drift']:.3f} | {row['cat drift']:.3f} | {row['dog to subject']:.3f} |")
    return "\n".join(lines)


def format_class_response(response):
    return "\n".join(f"base samples for {CLASS_PROMPTS[name]!r}: {row['recognised']:.0%} nearest a {name} of the "
                     f"fresh images; mean distance to the nearest dog {row['dog']:.3f}, cat {row['cat']:.3f}"
                     for name, row in response.items())


def two_class_model(out):
    """`out`/tiny-flux2-two-class, built once."""
    model = Path(out) / "tiny-flux2-two-class"
    if not (model / "model_index.json").is_file():
        print(f"a tiny two-class FLUX.2 [dev] base model in {model} (once)", flush=True)
        base_model("tiny-flux2-two-class", model)
    return model


def main_preservation(out, *flags):
    """`python tests/learning.py --preservation OUT [flags]`: the two-class base model (built once), its response
    to the class word, the subject trained plain and with each preservation, the table."""
    import shutil

    model = two_class_model(out)
    print(format_class_response(class_response(model)))
    shutil.rmtree(Path(out) / "preservation", ignore_errors=True)  # fresh runs each time
    table = preservation_figure(model, Path(out) / "preservation", *flags, quiet=False)
    print(f"\n{format_preservation_table(table)}")
    print("training runs: " + ", ".join(f"{mode} {table[mode]['seconds']:.0f} s" for mode in PRESERVATION_MODES))


# ---------------------------------------------------------------------------------------------------------------
# Edit (image-to-image) training


def relight(image):
    """The edit the edit LoRA learns: the same scene in another light, every colour's channels rotated (r, g, b) ->
    (b, r, g) (sky, disc and bar alike). Pixel-aligned with its condition, a fixed function of it, and not what the
    base model makes of the condition (it has never seen a reference image: it neither copies nor relights)."""
    return Image.fromarray(np.asarray(image.convert("RGB"))[..., [2, 0, 1]].copy(), "RGB")


def make_edit_pairs(folder, count=4, seed=1, size=EDIT_RESOLUTION):
    """`count` scenes of draw_scene's family (each its own sky, disc colour, place and size) as condition images
    folder/conditions/scene-<i>.png, and their relit versions, the targets, under the same names in folder/targets;
    returns (conditions folder, targets folder). Several scenes and one prompt: the LoRA must read the condition to
    know which target to make."""
    rng = np.random.default_rng(seed)
    conditions, targets = Path(folder, "conditions"), Path(folder, "targets")
    conditions.mkdir(parents=True, exist_ok=True)
    targets.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        scene = draw_scene(rng, size)
        scene.save(conditions / f"scene-{i}.png")
        relight(scene).save(targets / f"scene-{i}.png")
    return conditions, targets


def load_images(folder):
    """The folder's PNGs, sorted by name, as RGB PIL images."""
    images = []
    for path in sorted(Path(folder).glob("*.png")):
        with Image.open(path) as image:
            images.append(image.convert("RGB"))
    return images


def edit_latents(model, conditions, lora_dir=None, seeds=range(2), steps=SAMPLING_STEPS, prompt=EDIT_PROMPT):
    """[len(conditions), len(seeds), L, C]: Flux2Pipeline's final latents in edit mode (image=[condition], at the
    condition's size), base model or with the LoRA of `lora_dir`; the same seeds for every condition."""
    pipe, embeds = pipeline_and_embeds(model, lora_dir, prompt)
    with torch.no_grad():
        return torch.stack([torch.cat([pipe(image=[c], prompt_embeds=embeds, height=c.height, width=c.width,
                                            num_inference_steps=steps, output_type="latent",
                                            generator=torch.Generator().manual_seed(s)).images for s in seeds])
                            for c in conditions])


def edit_distance(latents, targets):
    """Mean over conditions of `distance` of each condition's samples [S, L, C] to its target's latents [1, L, C]."""
    return sum(distance(samples, target[None]) for samples, target in zip(latents, targets)) / len(targets)


def edit_learning_figure(model, conditions, targets, output_dir, *flags, steps=1000, quiet=True):
    """Train on the pairs (targets as instance images, --cond_data_dir conditions), then sample in edit mode on the
    training conditions -> (base distance, LoRA distance, the conditions' own distance) to the targets' latents;
    the last is what copying the condition unchanged would score."""
    from diffusers import AutoencoderKLFlux2

    train(model, targets, output_dir, "--cond_data_dir", conditions, *flags, steps=steps, quiet=quiet,
          resolution=EDIT_RESOLUTION, prompt=EDIT_PROMPT)
    vae = AutoencoderKLFlux2.from_pretrained(model, subfolder="vae")
    cond_images = load_images(conditions)
    goal = encode(vae, load_images(targets))
    copied = edit_distance(encode(vae, cond_images)[:, None], goal)
    return (edit_distance(edit_latents(model, cond_images), goal),
            edit_distance(edit_latents(model, cond_images, output_dir), goal), copied)


def main_edit(out, *flags):
    """`python tests/learning.py --edit OUT`: the 64 px tiny base model (built once), the pairs, a run, the figure."""
    out = Path(out)
    model = out / "tiny-flux2-64"
    if not (model / "model_index.json").is_file():
        print(f"a tiny FLUX.2 [dev] base model at {EDIT_RESOLUTION} px in {model} (once)", flush=True)
        base_model("tiny-flux2-64", model)
    conditions, targets = make_edit_pairs(out / "pairs")
    base, lora, copied = edit_learning_figure(model, conditions, targets, out / "edit-output", *flags, quiet=False)
    print(f"\nlatent distance of the edit to the targets: base {base:.3f} -> LoRA {lora:.3f} ({base / lora:.1f}x "
          f"closer; the condition itself: {copied:.3f})")


def main(out, *flags):
    """`make demo`: the tiny base model (built once), the subject, a run of the trainer, the learning figure."""
    out = Path(out)
    model = out / "tiny-flux2"
    if not (model / "model_index.json").is_file():
        print(f"a tiny FLUX.2 [dev] base model in {model} (once)", flush=True)
        base_model("tiny-flux2", model)
    images = out / "subject"
    make_subject(images)
    base, lora = learning_figure(model, images, out / "output", *flags, quiet=False)
    print(f"\nlatent distance to the subject: base {base:.3f} -> LoRA {lora:.3f} ({base / lora:.1f}x closer)")


if __name__ == "__main__":
    from train_dreambooth_lora_flux2 import quiet_library_imports

    quiet_library_imports()  # before diffusers' import: `make demo` shows the trainer's console, not the libraries'
    if len(sys.argv) > 1 and sys.argv[1] == "--write-base-models":
        write_base_models(sys.argv[2:])
    elif len(sys.argv) > 2 and sys.argv[1] == "--edit" and not sys.argv[2].startswith("-"):
        main_edit(*sys.argv[2:])
    elif len(sys.argv) > 2 and sys.argv[1] == "--preservation" and not sys.argv[2].startswith("-"):
        main_preservation(*sys.argv[2:])
    elif len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python tests/learning.py [--edit | --preservation] OUT_DIR [trainer flags...]")
    else:
        main(*sys.argv[1:])
