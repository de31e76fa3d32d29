"""Does a run learn its subject? Train the real script on one synthetic subject image, then sample with diffusers'
own Flux2Pipeline, with and without the saved LoRA, and measure how far the final latents are from the subject's.

Used by tests/test_learning.py and by `make demo`:

    python tests/learning.py OUT_DIR [trainer flags...]   # builds the tiny model and the subject, trains, prints

Edit (image-to-image) training has its own figure (tests/test_edit_learning.py): pairs of a scene and the same scene
relit, the real script trained with --cond_data_dir, Flux2Pipeline sampled in edit mode (image=[condition]) with and
without the LoRA, distances to the relit targets:

    python tests/learning.py --edit OUT_DIR [trainer flags...]

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
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    build_tiny_flux2(str(path))  # text encoder, tokenizer, scheduler and model_index.json
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    family = [draw_scene(rng, size) for _ in range(num_images)]
    blocks = 1 + int(np.log2(size // 16))  # 2 at 32 px, 3 at 64 px: 8x8 tokens at either size
    vae = AutoencoderKLFlux2(sample_size=size, in_channels=3, out_channels=3, block_out_channels=(8, 16, 16)[:blocks],
                             down_block_types=("DownEncoderBlock2D",) * blocks,
                             up_block_types=("UpDecoderBlock2D",) * blocks, layers_per_block=1, latent_channels=4,
                             norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)
    train_autoencoder(vae, pixels_of(family), vae_steps, batch_size)
    raw = encode(vae, family, normalise=False)  # [N, L, C]
    vae.bn.running_mean.copy_(raw.mean((0, 1)))
    vae.bn.running_var.copy_(raw.var((0, 1)) - vae.config.batch_norm_eps)
    vae.save_pretrained(Path(path, "vae"))
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * 4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16 * len(TEXT_ENCODER_OUT_LAYERS), timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4],
        guidance_embeds=True)
    train_generator(path, transformer, encode(vae, family), steps, batch_size)
    transformer.save_pretrained(Path(path, "transformer"))
    return path


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


def train_generator(path, transformer, data, steps, batch_size, lr=2e-3):
    """Rectified flow on `data` [N, L, C] (packed latents), prompt "a photo", guidance drawn in [1, 5]."""
    from diffusers import Flux2Pipeline
    from transformers import AutoTokenizer

    pipe = Flux2Pipeline.from_pretrained(path, tokenizer=None, vae=None, transformer=None)
    pipe.tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
    with torch.no_grad():
        embeds, text_ids = pipe.encode_prompt("a photo", device="cpu", max_sequence_length=MAX_SEQUENCE_LENGTH,
                                              text_encoder_out_layers=TEXT_ENCODER_OUT_LAYERS)
    side = int(data.shape[1] ** 0.5)
    img_ids = Flux2Pipeline._prepare_latent_ids(torch.zeros(1, 1, side, side))
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        x0 = data[torch.randint(0, len(data), (batch_size,))]
        noise = torch.randn_like(x0)
        sigma = torch.rand(batch_size)
        s = sigma.view(-1, 1, 1)
        pred = transformer(hidden_states=(1 - s) * x0 + s * noise, timestep=sigma,
                           guidance=torch.empty(batch_size).uniform_(1, 5),
                           encoder_hidden_states=embeds.expand(batch_size, -1, -1),
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


def final_latents(model, lora_dir=None, seeds=range(4), steps=SAMPLING_STEPS):
    """[len(seeds), L, C]: Flux2Pipeline's final latents for PROMPT, base model or with the LoRA of `lora_dir`."""
    pipe, embeds = pipeline_and_embeds(model, lora_dir, PROMPT)
    with torch.no_grad():
        return torch.cat([pipe(prompt_embeds=embeds, height=RESOLUTION, width=RESOLUTION, num_inference_steps=steps,
                               output_type="latent", generator=torch.Generator().manual_seed(s)).images
                          for s in seeds])


def distance(latents, subject):
    """Root mean square distance of each sample's latents to the subject's, averaged over samples."""
    return (latents - subject).pow(2).flatten(1).mean(1).sqrt().mean().item()


def train(model, images, output_dir, *flags, steps=1000, quiet=True, resolution=RESOLUTION, prompt=PROMPT):
    """The real script on the subject with the default LoRA targets (under `accelerate launch` unless quiet, as a
    user runs it); returns the finished process."""
    launcher = [] if quiet else ["-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
                                 "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd = [sys.executable, *launcher, str(ROOT / "train_dreambooth_lora_flux2.py"),
           "--pretrained_model_name_or_path", str(model), "--instance_data_dir", str(images),
           "--instance_prompt", prompt, "--output_dir", str(output_dir), "--resolution", str(resolution),
           "--repeats", "4", "--train_batch_size", "4", "--max_train_steps", str(steps), "--learning_rate", "3e-3",
           "--rank", "8", "--lora_alpha", "16", "--cache_latents",
           "--text_encoder_out_layers", *map(str, TEXT_ENCODER_OUT_LAYERS),
           "--max_sequence_length", str(MAX_SEQUENCE_LENGTH), "--seed", "0", "--report_to", "none",
           "--checkpointing_steps", str(10 * steps), "--precompute_cache_dir", "none", *map(str, flags)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
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
        print(f"building a tiny FLUX.2 [dev] base model at {EDIT_RESOLUTION} px in {model} (once)", flush=True)
        build_base_model(model, size=EDIT_RESOLUTION)
    conditions, targets = make_edit_pairs(out / "pairs")
    base, lora, copied = edit_learning_figure(model, conditions, targets, out / "edit-output", *flags, quiet=False)
    print(f"\nlatent distance of the edit to the targets: base {base:.3f} -> LoRA {lora:.3f} ({base / lora:.1f}x "
          f"closer; the condition itself: {copied:.3f})")


def main(out, *flags):
    """`make demo`: the tiny base model (built once), the subject, a run of the trainer, the learning figure."""
    out = Path(out)
    model = out / "tiny-flux2"
    if not (model / "model_index.json").is_file():
        print(f"building a tiny FLUX.2 [dev] base model in {model} (once)", flush=True)
        build_base_model(model)
    images = out / "subject"
    make_subject(images)
    base, lora = learning_figure(model, images, out / "output", *flags, quiet=False)
    print(f"\nlatent distance to the subject: base {base:.3f} -> LoRA {lora:.3f} ({base / lora:.1f}x closer)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--edit" and not sys.argv[2].startswith("-"):
        main_edit(*sys.argv[2:])
    elif len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python tests/learning.py [--edit] OUT_DIR [trainer flags...]")
    else:
        main(*sys.argv[1:])
