"""Does preservation preserve? A tiny FLUX.2 [dev] pretrained on two captioned classes ("a photo of dog": discs,
"a photo of cat": squares), one dog as the subject ("a photo of sks"), the real script trained three ways (plain,
--with_prior_preservation, --output_preservation), then diffusers' own Flux2Pipeline with and without each LoRA
(tests/learning.py: `python tests/learning.py --preservation OUT [flags]`). Subject fidelity: the LoRA's samples for
the instance prompt against the subject's latents; class drift: the LoRA's samples for "a photo of dog" against the
base model's, the same seeds."""

import json

import pytest

from tests import learning
from tests.tiny_metrics import build_tiny_dino

pytestmark = pytest.mark.slow  # every test here runs the script: not in `make test-fast`


def test_preservation_keeps_the_class_and_still_learns_the_subject(tmp_path):
    """One test, not three on a shared fixture: under `pytest -n 2` the tests of a module may land on both workers,
    which would each build the world and train the three runs. Every condition is checked and all failures are
    reported together.

    Measured (1,000 steps, rank 16, learning rate 6e-3, batch 4, 8 class images, weight 1 for either preservation;
    4 seeds, 28 sampling steps): subject distance base 1.088 -> plain 0.143 (0.13x), prior 0.390 (0.36x), output
    0.220 (0.20x); dog drift plain 0.928, prior 0.510 (0.55x plain), output 0.395 (0.43x); plain's dog samples
    0.335 from the subject (the base's 1.064). Training seeds 1 and 2: fidelity at most 0.14x, 0.36x, 0.23x, drift
    ratios prior 0.40 and 0.50, output 0.39 and 0.46. The base model's samples: 16/16 for dog and 14/16 for cat
    nearest an image of their class. The prior run trained as plain (--prior_loss_weight 0) drifts 0.850 (0.92x),
    the output run trained as plain (its flags, or --output_preservation_weight 0) 0.928 (1.00x): both planted
    once, failing here. Not asserted: "a photo of cat", which neither preservation covers, drifts in every mode
    (1.18 to 1.23). One math thread (as under `pytest -n 2`) moves each figure by at most 0.02. About 110 s on two
    cores with the world's build, 125 s on one thread; the world's base model is now shipped (tests/data/learning),
    about 50 s of that saved."""
    model = learning.base_model("tiny-flux2-two-class", tmp_path / "tiny-flux2-two-class")  # shipped weights
    response = learning.class_response(model)
    # each run's final validation also scores drift (--validation_metrics drift, a tiny random DINOv2 on the images
    # of "a photo of dog" against the base model's, same noise): it must tell plain training from output preservation
    # as the latent distances do. Measured: plain 0.076, prior 0.041, output 0.025 (0.34x plain)
    (tmp_path / "drift.txt").write_text(learning.CLASS_PROMPTS["dog"] + "\n")
    metrics = ["--validation_prompt", learning.SUBJECT_PROMPT, "--validation_epochs", "100000",
               "--validation_inference_steps", str(learning.SAMPLING_STEPS), "--num_validation_images", "4",
               "--validation_metrics", "drift", "--metrics_drift_prompts", tmp_path / "drift.txt",
               "--metrics_dino_model", build_tiny_dino(tmp_path / "dino")]
    table = learning.preservation_figure(model, tmp_path / "runs", *metrics)
    scored = {mode: json.loads((tmp_path / "runs" / mode / "validation" / "metrics.jsonl").read_text().splitlines()[-1])
              ["drift"] for mode in learning.PRESERVATION_MODES}
    print(f"drift scored by the script: {scored}")
    print(f"\n{learning.format_class_response(response)}\n{learning.format_preservation_table(table)}\ntraining runs: "
          + ", ".join(f"{mode} {table[mode]['seconds']:.0f} s" for mode in learning.PRESERVATION_MODES))
    failures = []
    # the base model responds to the class word: most samples of each class prompt are nearest an image of that class
    failures += [f"base samples for {learning.CLASS_PROMPTS[name]!r}: only {row['recognised']:.0%} nearest a {name}"
                 for name, row in response.items() if row["recognised"] < 0.75]
    # every mode learns the subject
    base, plain = table["base"], table["plain"]
    failures += [f"{mode} did not learn the subject: {table[mode]['fidelity']:.3f} vs base {base['fidelity']:.3f}"
                 for mode in learning.PRESERVATION_MODES if table[mode]["fidelity"] >= 0.6 * base["fidelity"]]
    # plain training turns the class into the subject: the drift to preserve against
    if plain["dog to subject"] >= 0.6 * base["dog to subject"]:
        failures.append(f"plain's dog samples did not become the subject: {plain['dog to subject']:.3f}")
    # both preservations keep the class prompt's samples far closer to the base model's than plain training does
    failures += [f"{mode} drifts {table[mode]['drift']:.3f}, {table[mode]['drift'] / plain['drift']:.2f}x plain's "
                 f"{plain['drift']:.3f}" for mode in ("prior", "output")
                 if table[mode]["drift"] >= 0.7 * plain["drift"]]
    if scored["output"] >= 0.6 * scored["plain"]:
        failures.append(f"the script's drift score: output {scored['output']:.3f} vs plain {scored['plain']:.3f}")
    assert not failures, (failures, response, table, scored)
