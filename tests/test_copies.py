"""Trimmed copies (issues 51, 57): `--write_copy FILE --keep NAMES` writes the script with Parts 1 and 2 and only the
options kept, for users who read and edit it: the code a person would have written for those options.

- Every copy (none, each single option, the diffusers example's scope, all) compiles, defines every name it reads,
  holds exactly the options asked for (and those they need), lists only their flags in --help, and names no flag it
  lacks in any string: messages, advice, docstrings, help; nor any word (Option.words) of an option it lacks in any
  text past its header: strings, docstrings, comments.
- Its seams are folded: no option machinery beyond the seams its options implement (none at all without options),
  no parameter that only a dropped option passed, none it accepts and ignores. The rewriter that folds them is tested
  on small sources, kind by kind.
- `--keep all` is the full script under a header; the header says what the copy is; a copy trims itself again when
  it keeps the copy writer (copies), and holds none of it otherwise.
- Refusals: an unknown option (listing the names), an existing file without --overwrite, the running script itself
  (even with --overwrite, through a link too), a folder, a folder that does not exist, the name of a module the copy
  imports: exit 2, one `error:` line. The header's SHA-256 is that of the text the copy was trimmed from.
- README.md's "Copy and edit" sizes are the copies' (tests/copy_sizes.py --write); the budgets are test_parts'.
- The disk cache names entries by the code that computes them: a copy with its prompt encoder, its image encoder or
  the closure where precompute calls it edited (each alone) encodes again the entries that code makes, and only those;
  an unedited copy reuses the full script's.

test_parts.py trains the copy without options to the full script's LoRA; test_copy_runs.py trains each single-option
copy's smallest run.
"""

import ast
import contextlib
import io
import os
import re
import subprocess
import sys
import types

import pytest

import train_dreambooth_lora_flux2 as T
from tests.conftest import ROOT, SCRIPT, SESSION_ENV, Zygote, base_args, make_images
from tests.copy_sizes import README, render
from tests.test_parts import option_flags, undefined_globals

SOURCE = SCRIPT.read_text(encoding="utf-8")
NAMES = [o.name for o in T.OPTIONS]
KINDS = ["none", "all", *T.OPTION_SETS, *NAMES]
COPY_FLAGS = {"--write_copy", "--keep", "--overwrite"}  # the copy command's own
FOREIGN = {"--cpu"}  # other programs' flags the advice names: `accelerate launch --cpu`
# Words that look like flags but belong to a file format an option reads: a prompts file line's own settings
FORMATS = {"--size": "validation_extras", "--steps": "validation_extras", "--guidance": "validation_extras"}


def expected(keep):
    """The options a copy asked for `keep` holds, in the script's order (an option brings those it needs)."""
    asked = {n for n in NAMES if keep == "all" or n == keep or n in T.OPTION_SETS.get(keep, ())}
    return [n for n in NAMES if n in asked or any(n in o.needs for o in T.OPTIONS if o.name in asked)]


def load_copy(source, path):
    """A copy run as a module whose __file__ is its own file (write_copy reads it)."""
    module = types.ModuleType(f"copy_{path.stem}")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module  # dataclasses look their module up while it runs
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module


def write(module, *argv):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        module.write_copy([str(a) for a in argv])
    return out.getvalue()


def literal_flags(source):
    """{--flag: line} of every flag-like word in the string literals of `source` (f-strings' text too)."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for name in re.findall(r"(?<![\w-])--[a-z][a-z0-9_]*", node.value):
                found.setdefault(name, node.lineno)
    return found


def write_copies(factory, name, kinds):
    """{kind: the copy `--keep kind` wrote, as keep_KIND.py (diffusers.py would shadow diffusers), in a new folder
    `name`}. A copy costs about 4 CPU-seconds and modules ask for the same ones: each is written once a session, into
    a folder both xdist workers share (the parent of their base folders), under a lock, and copied from there."""
    import fcntl
    import hashlib
    import shutil

    folder, digest = factory.mktemp(name), hashlib.sha256(SCRIPT.read_bytes()).hexdigest()[:12]
    shared = factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else factory.getbasetemp()
    shared = shared / f"copies-{digest}"
    shared.mkdir(exist_ok=True)
    odd = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[-1] in "13579"
    for keep in reversed(kinds) if odd else kinds:  # two workers asking at once each write a half
        written = shared / f"keep_{keep}.py"
        with open(shared / f"keep_{keep}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker may be writing it
            if not written.exists():
                write(T, "--write_copy", written, "--keep", keep)
        shutil.copyfile(written, folder / written.name)
    return {keep: folder / f"keep_{keep}.py" for keep in kinds}


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    return write_copies(tmp_path_factory, "copies", KINDS)


@pytest.mark.parametrize("keep", KINDS)
def test_a_copy_holds_its_options_and_names_no_flag_it_lacks(copies, keep):
    source = copies[keep].read_text()
    assert undefined_globals(source) == set(), keep
    module = load_copy(source, copies[keep])
    names = expected(keep)
    assert [o.name for o in getattr(module, "OPTIONS", [])] == names
    assert not re.search(rf"^# Option: (?!({'|'.join(names) or '$^'}) )", source, re.M)
    parser = module.build_parser()
    flags = {name for action in parser._actions for name in action.option_strings}
    help_text = parser.format_help()
    for option in T.OPTIONS:  # --help lists the options kept and none other (a flag needing one gone goes with it)
        for name in option_flags(option):
            shown = option.name in names and not re.search(rf'flag\("{name}",.*# option: (?!{"|".join(names)}\b)',
                                                           SOURCE)
            assert (re.search(rf"{name}\b", help_text) is not None) == shown, (keep, name)
    allowed = flags | COPY_FLAGS | FOREIGN | {word for word, option in FORMATS.items() if option in names}
    lacking = {name: line for name, line in literal_flags(source).items() if name not in allowed and not (
        name.endswith("_") and any(f.startswith(name) for f in flags))}  # an f-string's --metrics_{which}_model
    assert lacking == {}, keep
    assert all(len(line) <= 120 for line in source.splitlines())


def test_all_is_the_full_script_under_a_header_that_says_what_a_copy_is(copies):
    full, lines = SOURCE.splitlines(), copies["all"].read_text().splitlines()
    assert lines[:2] == full[:2] and lines[lines.index(full[2]):] == full[2:]  # full[2]: the docstring's first line
    header = " ".join(line.removeprefix("# ") for line in lines[2:lines.index(full[2])])
    assert "--write_copy FILE --keep NAMES trims this copy further" in header
    ema = copies["ema"].read_text().splitlines()
    header = " ".join(line.removeprefix("# ") for line in ema[2:ema.index(full[2])])
    for words in (f"version {T.VERSION}", "and the options ema.", "The full script, with every option,",
                  "written without the copy writer (--keep copies keeps it), so it does not trim itself again"):
        assert words in header, words
    assert "def write_copy" not in copies["ema"].read_text() and "def write_copy" in copies["copies"].read_text()


def test_a_copy_trims_itself_again(copies, tmp_path):
    """The copy with every option, and the one with only the copy writer, write the same copies as the full script
    (their headers aside)."""
    for writer in ("all", "copies"):
        module = load_copy(copies[writer].read_text(), copies[writer])
        for keep in ("ema", "manifest", "none") if writer == "all" else ("none",):
            write(module, "--write_copy", tmp_path / f"{keep}.py", "--keep", keep, "--overwrite")
            again, first = (path.read_text().split('"""', 1)[1] for path in (tmp_path / f"{keep}.py", copies[keep]))
            assert again == first, (writer, keep)


def test_a_copy_keeps_what_the_options_it_keeps_need(copies):
    assert expected("manifest") == ["disk_cache", "manifest"]
    assert "class DiskStore" in copies["manifest"].read_text() and "class DiskStore" not in copies["none"].read_text()


@pytest.mark.parametrize("argv, message", [
    (["--keep", "ema,emma,nope"], f"--keep ema,emma,nope: no option emma, nope; this script's options are "
                                  f"{', '.join(NAMES)} (or none, all, diffusers)"),
    (["--keep", "ema", "--unknown"], "unrecognized arguments: --unknown"),
])
def test_a_bad_keep_is_refused_listing_the_options(argv, message, tmp_path):
    with pytest.raises(T.UsageError) as refused:
        write(T, "--write_copy", tmp_path / "copy.py", *argv)
    assert message in str(refused.value)
    assert not (tmp_path / "copy.py").exists()


def test_a_copy_neither_overwrites_a_file_nor_the_running_script(tmp_path):
    """Refused, exit 2 and one error line, before anything is written; the script lives in tmp_path, so a failing check
    would overwrite only that copy of it. A copy named after a module of Python's (copy.py) would fail at its first
    import when run: refused too."""
    script = tmp_path / "train.py"
    script.write_text(SOURCE)
    (tmp_path / "link.py").symlink_to(script)
    (tmp_path / "mine.py").write_text("my own edits")
    (tmp_path / "folder").mkdir()
    cases = {"train.py": "is this script", "link.py": "is this script", "mine.py": "exists; pass --overwrite",
             "folder": "is a folder", "copy.py": "in place of Python's own copy module"}
    for name, message in cases.items():
        extra = ["--overwrite"] if name.endswith("train.py") or name == "link.py" else []
        proc = subprocess.run([sys.executable, str(script), "--write_copy", str(tmp_path / name), "--keep", "ema",
                               *extra], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                              env={**SESSION_ENV, "HF_HUB_OFFLINE": "1"})
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and message in proc.stderr, (name, proc)
        assert len(proc.stderr.strip().splitlines()) == 1
    assert script.read_text() == SOURCE and (tmp_path / "mine.py").read_text() == "my own edits"
    assert not (tmp_path / "copy.py").exists()
    write(T, "--write_copy", tmp_path / "mine.py", "--keep", "ema", "--overwrite")
    assert (tmp_path / "mine.py").read_text().startswith("#!/usr/bin/env python")
    assert os.stat(tmp_path / "mine.py").st_mode & 0o777 == os.stat(SCRIPT).st_mode & 0o777


def test_a_copy_named_after_a_module_it_imports_or_in_no_folder_is_refused(tmp_path):
    """diffusers.py was written and could not run (it imported itself in place of diffusers); a copy into a folder that
    does not exist stopped with exit 1 as if removed during the run. The modules are the script's own imports (its
    import and from lines, __import__ and find_spec: bitsandbytes, prodigyopt) and Python's, not a list kept by hand."""
    for name, message in (("diffusers.py", "in place of the library diffusers module"), ("torch.py", "library torch"),
                          ("PIL.py", "library PIL module"), ("yaml.py", "library yaml module"),
                          ("bitsandbytes.py", "library bitsandbytes"), ("prodigyopt.py", "library prodigyopt"),
                          ("json.py", "Python's own json module"), ("nope/sub/c.py", f"no folder {tmp_path}/nope/sub; "
                                                                                  "make it first")):
        with pytest.raises(T.UsageError, match=re.escape(f"--write_copy {tmp_path / name}: ")) as refused:
            write(T, "--write_copy", tmp_path / name, "--keep", "none")
        assert message in str(refused.value), name
    assert list(tmp_path.iterdir()) == []
    write(T, "--write_copy", tmp_path / "diffusers_lora.py", "--keep", "none")  # a name of no module: written


def test_a_copys_header_states_the_sha256_of_the_text_it_was_trimmed_from(tmp_path):
    """Of the text, not of its path: a copy of a copy states the first copy's digest."""
    import hashlib

    def stated(path):
        header = " ".join(line.removeprefix("# ") for line in path.read_text().splitlines()[2:8])
        return re.search(r"has SHA-256 ([0-9a-f]+)\.\.\.\)", header).group(1)
    write(T, "--write_copy", tmp_path / "first.py", "--keep", "all")
    assert stated(tmp_path / "first.py") == hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    first = (tmp_path / "first.py").read_text()
    write(load_copy(first, tmp_path / "first.py"), "--write_copy", tmp_path / "second.py", "--keep", "ema")
    assert stated(tmp_path / "second.py") == hashlib.sha256(first.encode()).hexdigest()[:12] != stated(
        tmp_path / "first.py")


def test_readme_gives_the_copies_sizes():
    text = README.read_text(encoding="utf-8")
    assert render() in text, "README.md's copy sizes are stale: run `python tests/copy_sizes.py --write`"


@pytest.fixture(scope="module")
def cached_runs(tiny_model, tmp_path_factory):
    """The same run over one disk cache: the full script, an unedited copy keeping the disk cache, then that copy with
    one place of the code that makes the entries edited at a time: the prompt encoder (a statement added), the image
    encoder (the same), and the pixels scaled where precompute calls it (prepare_latents's `encode` closure)."""
    root = tmp_path_factory.mktemp("stale")
    images = root / "images"
    make_images(str(images))
    copy = root / "kept.py"  # (not copy.py: run as a script, it would shadow Python's copy module)
    write(T, "--write_copy", copy, "--keep", "disk_cache")
    source, scripts = copy.read_text(), {"full": SCRIPT, "copy": copy}
    for name, function in (("prompts", "encode_prompts"), ("images", "encode_images"), ("closure", None)):
        if function:
            body = re.search(rf"^def {function}\(.*?\n    \"\"\".*?\"\"\"\n", source, re.M | re.S).end()
            edited = source[:body] + "    _ = 'edited'  # a user's change\n" + source[body:]
        else:
            call = "torch.stack([dataset.pixels(k) for k in keys])"
            assert source.count(call) == 1
            edited = source.replace(call, f"{call} * 0.5")
        scripts[name] = root / f"edited_{name}.py"
        scripts[name].write_text(edited)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    runs = {}
    for name, script in scripts.items():
        args = base_args(tiny_model, images, root / name, "--cache_latents", "--max_train_steps", "1",
                         "--precompute_cache_dir", root / "cache")
        cmd = [sys.executable, str(script), *args]
        proc = (Zygote.run(cmd, env, 600) if Zygote.serves(env) else
                subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600))
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = proc.stderr
    return runs


def encoded(log):
    """(prompts encoded, of those missing), (images encoded, of those missing), from a run's log."""
    prompts = re.search(r"encoded (\d+) of (\d+) missing prompts", log).groups()
    images = re.search(r"encoded (\d+) of (\d+) missing images", log)
    assert images or "all latents cached; the VAE is not loaded" in log
    return tuple(map(int, prompts)), tuple(map(int, images.groups())) if images else (0, 0)


def test_an_edited_copy_encodes_again_what_its_edit_makes_and_reuses_the_rest(cached_runs):
    """Each edit alone: an identity that fingerprinted the image encoder for prompts too, or missed the closure where
    precompute calls the encoder (the old latents reused, the LoRA the unedited one), would fail here. The unedited
    copy is other code than the full script (its seams folded: prompt_encoder without the options' encoders), so it
    makes its own entries once; each edited copy then reuses those its edit does not touch."""
    (prompts, _), (images, _) = encoded(cached_runs["full"])
    assert prompts > 0 and images > 0
    assert encoded(cached_runs["copy"]) == ((prompts, prompts), (images, images))
    assert encoded(cached_runs["prompts"]) == ((prompts, prompts), (0, 0))
    assert encoded(cached_runs["images"]) == ((0, 0), (images, images))
    assert encoded(cached_runs["closure"]) == ((0, 0), (images, images))


# ---------------------------------------------------------------------------------------------------- folded seams


def words_pattern(words):
    """A regex of `words` as the copy writer matches them: at a word's start, a flag whole, a word without capitals
    in any case."""
    parts = [rf"(?<![\w-]){re.escape(w)}" + (r"(?![\w-])" if w.startswith("--") else "") for w in words]
    # no words: (?!) matches nothing ("$^" would match a blank line)
    return re.compile("|".join(f"(?i:{p})" if w == w.lower() else p for w, p in zip(words, parts)) or "(?!)")


def texts(source):
    """(line, text) of every string and comment of `source` past its header and its docstring's first line."""
    import tokenize
    start = next(i for i, line in enumerate(source.splitlines()) if line.startswith('"""')) + 2
    return [(token.start[0] + k, line) for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type in (tokenize.STRING, tokenize.COMMENT) for k, line in enumerate(token.string.split("\n"))
            if token.start[0] + k > start]


@pytest.mark.parametrize("keep", KINDS)
def test_a_copy_names_no_word_of_an_option_it_dropped(copies, keep):
    """Its help, messages, docstrings and comments speak of what it holds: no flag and no word (Option.words) of an
    option it lacks, and without options no word of the seam (T.MACHINERY)."""
    kept = expected(keep)
    words = [w for o in T.OPTIONS if o.name not in kept for w in (*o.words, *option_flags(o))]
    words += list(T.MACHINERY) if not kept else []
    pattern = words_pattern(words)
    named = [(line, text.strip()[:100]) for line, text in texts(copies[keep].read_text()) if pattern.search(text)]
    assert named == [], keep


@pytest.mark.parametrize("keep", KINDS)
def test_a_copy_has_no_machinery_beyond_the_seams_its_options_implement(copies, keep):
    """Without options: no Option, Hooks, SEAMS, option(), flag() nor a `hooks` anywhere, plain calls instead; with
    some: SEAMS holds the seams they implement and no other, and every seam call left is one of them."""
    source, kept = copies[keep].read_text(), expected(keep)
    tree = ast.parse(source)
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    seams = set(T.SEAMS) | {"wake"}
    calls = {(n.func.attr, n.args[0].value if n.args and isinstance(n.args[0], ast.Constant) else None)
             for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and getattr(n.func.value, "id", getattr(n.func.value, "attr", None)) == "hooks"}
    if not kept:
        assert not defined & {"Option", "Hooks", "SEAMS", "OPTIONS", "option", "flag"}, keep
        assert re.search(r"\bhooks\b", source) is None and calls == set()
        return
    implemented = {n for o in T.OPTIONS if o.name in kept for n in dir(o) if n in T.SEAMS}
    module = load_copy(source, copies[keep])
    assert set(module.SEAMS) == implemented, keep
    assert {seam for method, seam in calls if seam in seams} <= implemented, keep


def parameters(source):
    """{function name: ({parameters}, {those its body reads}, {those some call passes})}: functions and methods
    whose name is defined once."""
    tree = ast.parse(source)
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    names, found, calls = [f.name for f in functions], {}, {}
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        calls.setdefault(getattr(call.func, "attr", getattr(call.func, "id", None)), []).append(call)
    called = {id(c.func) for cs in calls.values() for c in cs}
    values = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in called}  # callbacks
    for fn in functions:
        if names.count(fn.name) != 1 or fn.name in values or fn.name.startswith("__"):  # a callback, a protocol
            continue
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
        method = params[:1] in (["self"], ["cls"])
        reads = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        passed = set()
        for call in calls.get(fn.name, []):
            if getattr(call.func, "attr" if method else "id", None) == fn.name:
                passed |= set(params[int(method):][:len(call.args)]) | {k.arg for k in call.keywords}
        found[fn.name] = (set(params[int(method):]), reads, passed)
    return found


FULL_PARAMETERS = parameters(SOURCE)


@pytest.mark.parametrize("keep", KINDS)
def test_a_copy_has_no_parameter_only_a_dropped_option_passes_nor_one_it_ignores(copies, keep):
    """A parameter the full script's calls pass and the copy's never do was passed by code that went (mask,
    conditions, num_instance, hooks...): the copy writer removes it with what reads it; a parameter the full script's
    function reads and the copy's does not is accepted and ignored: removed too."""
    for name, (params, reads, passed) in parameters(copies[keep].read_text()).items():
        full_params, full_reads, full_passed = FULL_PARAMETERS.get(name, (set(), set(), set()))
        assert not params & full_passed - passed, (keep, name, params & full_passed - passed)
        assert not params & full_reads - reads, (keep, name, params & full_reads - reads)


def rewritten(source, folded=(), full=None):
    """`source` through the copy writer's rewriter, with seams `folded`."""
    import textwrap
    source = textwrap.dedent(source)
    return T.rewrite(source, textwrap.dedent(full) if full else source, frozenset(folded))


def test_the_copy_writer_folds_each_kind_of_seam_call_as_it_reads():
    """each/collect: gone (an empty list in an expression); first: its default's code; chain: the value; context: no
    item; flag: False, and the branches and operands that leaves constant; a kept seam stays."""
    source = """
        def run(hooks, args, x):
            hooks.each("check")
            y = hooks.first("optimizer", x, default=lambda: make(x))
            z = hooks.chain("before_lora", y, args) + hooks.collect("notes")
            with hooks.context("validation_weights"), open(x) as f:
                f.read()
            if not hooks.flag("places_transformer"):
                y.to(x)
            keep = hooks.first("kept") or x
            return [z, *hooks.collect("describe", x)], keep

        print(run)  # used, its parameters as they are
        """
    out = rewritten(source, {"check", "optimizer", "before_lora", "notes", "validation_weights",
                             "places_transformer", "describe"})
    assert "hooks.each" not in out and "y = make(x)" in out and "z = y\n" in out
    assert "with open(x) as f:" in out and "    y.to(x)" in out and "if " not in out
    assert "return [z], keep" in out and 'hooks.first("kept") or x' in out  # not folded: kept


def test_the_copy_writer_removes_what_folding_leaves_unread():
    """A parameter only a dropped seam read goes with what every call passes for it, a constant one is written in; a
    dataclass field no line reads goes with its constructor argument; a local assigned and never read, a definition
    and an import nothing uses go too."""
    full = """
        import json
        import re
        from dataclasses import dataclass

        @dataclass
        class Data:
            seed: int
            hooks: object = None

        def helper(a, hooks=None, mask=None, verbose=False):
            hooks.each("x")
            if mask is not None:
                a = a * mask
            if verbose:
                print(a)
            return a

        def unused():
            return re.compile("x")

        class Hooks:
            def first(self, seam):
                return None

        def main(args):
            hooks = Hooks(args)
            data = Data(1, hooks)
            extra = hooks.first("x")
            return helper(data.seed, hooks), json.dumps(extra)
        """
    copy = full.replace("""            if mask is not None:
                a = a * mask
""", "")
    out = rewritten(copy, {"x"}, full)
    assert "def helper(a):" in out and "return helper(data.seed), json.dumps(None)" in out
    assert "hooks" not in out and "Data(1)" in out and "class Data:\n    seed: int\n" in out
    assert "def unused" not in out and "import re" not in out and "import json" in out and "print(a)" not in out
