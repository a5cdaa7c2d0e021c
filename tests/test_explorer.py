"""The attention explorer's panels compute what the analysis functions compute: a head
switched off is ``analysis=heads``' ablation, the model view is ``attention_report``'s
weights, the relevance of a chosen class is ``class_relevance``'s; pruned checkpoints,
inputs and settings. The page in a real browser: tests/test_explorer_browser.py."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import socket
import threading
import time
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from matplotlib import colormaps
from omegaconf import OmegaConf
from PIL import Image, ImageDraw, ImageFile

from tests.conftest import ROOT, compose_config
from tests.test_predict import draw_digit
from vit_mnist.analysis.attention import attention_report, cls_attention
from vit_mnist.analysis.heads import heads_switched_off, heads_zeroed
from vit_mnist.analysis.logit_attribution import direct_logit_attribution
from vit_mnist.analysis.pruning import prune_heads
from vit_mnist.analysis.relevance import class_relevance
from vit_mnist.analysis.roles import ROLE_COLUMNS
from vit_mnist.errors import ConfigError
from vit_mnist.settings import ExploreSettings, check_settings
from vit_mnist.tasks.explore import Explorer, load_explorer, main, original_heads, read_head_table
from vit_mnist.tasks.explore import server as server_module
from vit_mnist.tasks.explore import session as explorer_module
from vit_mnist.training.callbacks.attention_maps import panel_indices
from vit_mnist.training.module import RUN_INFO_KEY, ViTClassifier

MODEL = {"embed_dim": 32, "depth": 3, "num_heads": 4, "patch_size": 7}


def tiny_module(seed: int = 0) -> ViTClassifier:
    """An untrained tiny model whose heads all matter: weights far from the 0.02 init."""
    torch.manual_seed(seed)
    module = ViTClassifier(model=dict(MODEL))
    with torch.no_grad():
        for p in module.net.parameters():
            p.normal_(0, 0.3)
    return module.eval()


def save_ckpt(path: Path, module: ViTClassifier, **extra) -> Path:
    """A checkpoint as train.py writes one, with the synthetic dataset's config."""
    data = OmegaConf.to_container(OmegaConf.load(ROOT / "configs/data/synthetic.yaml"))
    torch.save(
        {
            "state_dict": module.state_dict(),
            "hyper_parameters": dict(module.hparams),
            "pytorch-lightning_version": L.__version__,
            RUN_INFO_KEY: {"data": data},
            **extra,
        },
        path,
    )
    return path


def explore_cfg(tmp_path: Path, *overrides: str):
    return compose_config("explore", list(overrides), tmp_path / "run")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One image at a time, as the explorer runs (scripts/explore.py sets one thread): a
    second thread only waits for the first, and on a busy machine for much longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_ckpt(tmp_path_factory.mktemp("ckpt") / "tiny.ckpt", tiny_module())


@pytest.fixture(scope="module")
def explorer(tiny_ckpt, tmp_path_factory) -> Explorer:
    return load_explorer(explore_cfg(tmp_path_factory.mktemp("x"), f"ckpt_path={tiny_ckpt}"))


@pytest.fixture(scope="module")
def page(explorer):
    """The page of ``explorer``, built, not launched."""
    pytest.importorskip("gradio", reason="the explorer's page needs Gradio (extra explore)")
    from vit_mnist.tasks.explore import build_page

    return build_page(explorer)


def components(page, kind: str) -> list:
    """The page's components of Gradio class ``kind`` (``"Image"``, ...)."""
    return [b for b in page.blocks.values() if type(b).__name__ == kind]


def an_image(explorer: Explorer) -> torch.Tensor:
    return explorer.from_test(3)[0]


def test_a_head_switched_off_gives_the_ablation_logits(explorer):
    model, x = explorer.model, an_image(explorer)
    # The page's check boxes: every head on but head 2 of layer 1.
    checked = [[0, 1, 2, 3], [0, 1, 3], [0, 1, 2, 3]]
    assert explorer.heads_off(checked) == [(1, 2)]
    view = explorer.view(x, heads_off=explorer.heads_off(checked))
    with torch.no_grad():
        with heads_zeroed(model, 1, [2]):  # eval.py analysis=heads' ablation
            ablated = model(x)[0]
        plain = model(x)[0]
    torch.testing.assert_close(view.explanation.logits, ablated, atol=1e-5, rtol=1e-5)
    assert (view.explanation.logits - plain).abs().max() > 1e-3  # the head mattered
    torch.testing.assert_close(view.explanation.base_probs, plain.softmax(-1))
    assert "1 head off" in view.summary and "points" in view.summary
    assert "head 2 OFF" not in view.summary  # captions belong to the picture, not the text
    # Two heads of two layers at once: the nested masks of heads_switched_off.
    two = explorer.view(x, heads_off=[(0, 1), (2, 3)]).explanation.logits
    with torch.no_grad(), heads_zeroed(model, 0, [1]), heads_zeroed(model, 2, [3]):
        torch.testing.assert_close(two, model(x)[0], atol=1e-5, rtol=1e-5)


def test_the_model_view_is_attention_reports_weights(explorer):
    model, x = explorer.model, an_image(explorer)
    view = explorer.view(x, layer=2, token=6, matrix_head=1)
    report = attention_report(model, x)
    e = view.explanation
    for layer, w in enumerate(report.weights):
        torch.testing.assert_close(e.cls_maps[layer], cls_attention(w, 4)[0])
        torch.testing.assert_close(e.entropy[layer], report.entropy[layer])
        torch.testing.assert_close(e.distance[layer], report.distance[layer])
    # The query view: patch (1, 1) is token 6; its row of layer 2, per head.
    torch.testing.assert_close(e.token_maps(2, 6), report.weights[2][0, :, 6, 1:].reshape(4, 4, 4))
    assert view.seen.shape == (224, 224, 3) and view.seen.dtype.name == "uint8"
    assert view.model_view.shape[0] > 3 * 112 and view.model_view.shape[2] == 3
    assert view.matrix is not None and view.matrix.shape[1] >= 17 * 6
    assert explorer.view(x).matrix is None
    assert list(view.top) == [explorer.class_names[int(c)] for c in e.probs.topk(3).indices]


def test_relevance_of_a_chosen_class_is_class_relevance(explorer):
    model, x = explorer.model, an_image(explorer)
    view = explorer.view(x)
    predicted = view.explanation.predicted
    other = (predicted + 1) % 10
    torch.testing.assert_close(view.explanation.relevance, class_relevance(model, x)[0][0])
    assert view.explanation.target == predicted
    chosen = explorer.view(x, target=other).explanation
    assert chosen.target == other
    torch.testing.assert_close(chosen.relevance, class_relevance(model, x, target=other)[0][0])
    assert not torch.equal(chosen.relevance, view.explanation.relevance)
    # With a head off, the relevance is that of the ablated model.
    off = explorer.view(x, heads_off=[(0, 0)], target=other).explanation
    with heads_switched_off(model, [(0, 0)]):
        torch.testing.assert_close(off.relevance, class_relevance(model, x, target=other)[0][0])


def test_a_pruned_checkpoint_shows_its_remaining_heads(tmp_path):
    module = tiny_module()
    net, args = prune_heads(module.net, MODEL, [(0, 1), (0, 3), (2, 0)])
    pruned = ViTClassifier(model=args)
    pruned.net.load_state_dict(net.state_dict())
    path = save_ckpt(tmp_path / "pruned.ckpt", pruned, pruned_heads=["0:1 2:0", "0:3"])
    explorer = load_explorer(explore_cfg(tmp_path, f"ckpt_path={path}"))
    assert explorer.head_names == [[0, 2], [0, 1, 2, 3], [1, 2, 3]]
    assert original_heads(torch.load(path, weights_only=True)) == explorer.head_names
    x = an_image(explorer)
    view = explorer.view(x, heads_off=[(2, 0)], layer=0, matrix_head=1)
    assert [m.shape[0] for m in view.explanation.cls_maps] == [2, 4, 3]
    # Switching off the pruned model's head 0 of layer 2 (head 1 before pruning) is
    # switching off heads 0:1, 0:3, 2:0 and 2:1 of the unpruned model.
    with torch.no_grad(), heads_switched_off(module.net, [(0, 1), (0, 3), (2, 0), (2, 1)]):
        full = module.net(x)[0]
    torch.testing.assert_close(view.explanation.logits, full, atol=1e-5, rtol=1e-5)


def test_inputs_are_read_as_predict_reads_them(explorer, tmp_path):
    x = explorer.from_file(draw_digit(tmp_path / "seven.png", seed=1))
    assert x.shape == (1, 1, 28, 28)
    assert float(x.max()) == pytest.approx((1 - 0.1307) / 0.3081, abs=1e-4)
    fake = tmp_path / "fake.png"
    fake.write_text("not an image")
    with pytest.raises(ValueError, match="fake.png cannot be read"):
        explorer.from_file(fake)
    with pytest.raises(ValueError, match="notes.txt: not one of"):
        explorer.from_file(tmp_path / "notes.txt")

    def as_sent(image, kind="PNG"):  # as the Draw tab's canvas sends a drawing
        data = io.BytesIO()
        image.save(data, kind)
        return f"data:image/png;base64,{base64.b64encode(data.getvalue()).decode()}"

    side = explorer_module.CANVAS_SIDE
    assert explorer.from_sketch(as_sent(Image.new("RGBA", (side, side)))) is None  # blank
    assert explorer.from_sketch(None) is None and explorer.from_sketch("") is None
    drawing = Image.new("RGBA", (side, side))
    ImageDraw.Draw(drawing).line([(140, 60), (140, 220)], fill="black", width=22)
    assert explorer.from_sketch(as_sent(drawing)).shape == (1, 1, 28, 28)
    # What only an API call can send: another size (checked before decoding), another
    # format, not base64, not a data URL.
    for bad in (
        as_sent(Image.new("RGBA", (side + 1, side))),
        as_sent(drawing.convert("RGB"), "JPEG"),
        "data:image/png;base64,@@@",
        "data:image/png;base64," + "A" * (8 * side * side + 4),  # too long to decode
        "http://example.com/7.png",
        7,
    ):
        with pytest.raises(ValueError, match="PNG data URL of 280 x 280 pixels"):
            explorer.from_sketch(bad)
    with pytest.raises(ValueError, match="choose 0 to 127"):
        explorer.from_test(128)
    # A click at pixel (x=60, y=200) of the 224-px picture is patch row 3, column 1.
    assert explorer.token_at(60, 200) == 1 + 3 * 4 + 1


def test_the_examples_are_the_tensorboard_panel(explorer, tiny_ckpt, tmp_path):
    images, labels = explorer.examples
    assert labels.tolist() == list(range(10))
    cfg = explore_cfg(tmp_path, f"ckpt_path={tiny_ckpt}")
    from vit_mnist.training.checkpointing import checkpoint_datamodule, read_checkpoint

    dm = checkpoint_datamodule(cfg, tiny_ckpt, read_checkpoint(tiny_ckpt)[RUN_INFO_KEY])
    dm.setup("fit")
    val_labels = dm.data_val.tensors[1]
    chosen = panel_indices(val_labels, 10)
    torch.testing.assert_close(images, dm.data_val.tensors[0][chosen].float())


def test_head_table_from_eval_csv(tmp_path):
    path = tmp_path / "head_importance.csv"
    path.write_text(
        "layer,head,acc,loss,acc_drop,loss_increase,grad_importance,entropy_nats,"
        "mean_distance_px\n0,0,0.9,0.3,0.01,0.1,0.2,1.5,7.0\n0,1,0.8,0.4,0.11,0.2,0.3,1.2,5.0\n"
    )
    headers, table = read_head_table(path)
    assert headers[:3] == ["layer", "head", "acc_drop (points)"] and "grad_importance" in headers
    assert [row[:3] for row in table] == [[0, 1, 11.0], [0, 0, 1.0]]
    # eval.py analysis=roles' roles.csv: the role figures instead.
    roles = tmp_path / "roles.csv"
    columns = ["layer", "head", *ROLE_COLUMNS, "acc_drop", "acc_drop_0", "most_hurt_class"]
    values = [0, 0, *range(len(ROLE_COLUMNS)), 0.02, 0.05, "0"]
    roles.write_text(",".join(columns) + "\n" + ",".join(map(str, values)) + "\n")
    headers, table = read_head_table(roles)
    assert headers == ["layer", "head", "acc_drop (points)", *ROLE_COLUMNS, "most_hurt_class"]
    assert table == [[0, 0, 2.0, *map(float, range(len(ROLE_COLUMNS))), "0"]]
    # The page shows the table under those headers.
    pytest.importorskip("gradio", reason="the explorer's page needs Gradio (extra explore)")
    from vit_mnist.tasks.explore import build_page

    explorer = Explorer(model=tiny_module().net.eval(), head_table=(headers, table))
    frames = [b for b in build_page(explorer).blocks.values() if type(b).__name__ == "Dataframe"]
    assert [list(f.headers) for f in frames] == [headers]
    with pytest.raises(ConfigError, match="heads_csv=.*missing.csv cannot be read"):
        read_head_table(tmp_path / "missing.csv")


def test_settings_and_errors(tmp_path, tiny_ckpt, capsys):
    cfg = explore_cfg(tmp_path, f"ckpt_path={tiny_ckpt}")
    values = check_settings(cfg, ExploreSettings)
    assert values["server_name"] == "127.0.0.1" and values["heads_csv"] is None
    with pytest.raises(ConfigError, match="server_port=0 must be in"):
        check_settings(explore_cfg(tmp_path, "ckpt_path=x", "server_port=0"), ExploreSettings)
    with pytest.raises(SystemExit) as e:
        main(explore_cfg(tmp_path, f"ckpt_path={tmp_path / 'nothing.ckpt'}"))
    assert e.value.code == 2 and "nothing.ckpt does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(explore_cfg(tmp_path, f"ckpt_path={tiny_ckpt}", f"heads_csv={tmp_path / 'h.csv'}"))
    assert e.value.code == 2 and "h.csv cannot be read" in capsys.readouterr().err


def test_two_sessions_at_once_do_not_see_each_others_heads(explorer):
    """Session A switches every head off while session B, at the same moment, asks for
    the same image with every head on: B must get the all-heads-on answer. A is held in
    the middle of its computation (a test hook on the classifier, the last layer) until B
    has finished, so B runs exactly while A's heads are off."""
    model, x = explorer.model, an_image(explorer)
    everything = [(layer, h) for layer in range(3) for h in range(4)]
    alone_a = explorer.view(x, heads_off=everything).explanation
    alone_b = explorer.view(x).explanation
    a_held, b_done = threading.Event(), threading.Event()
    results, left_on_model = {}, []

    def hold_a(module, inputs):
        if threading.current_thread().name == "A" and not a_held.is_set():
            # What A leaves on the shared model while it waits: hooks, a training flag.
            left_on_model.extend(
                m for m in model.modules() if m._forward_pre_hooks and m is not module
            )
            left_on_model.extend(m for m in model.modules() if m._forward_hooks or m.training)
            a_held.set()
            b_done.wait(timeout=30)

    def session(name, heads_off):
        try:
            results[name] = explorer.view(x, heads_off=heads_off)
        finally:
            b_done.set()

    handle = model.head.register_forward_pre_hook(hold_a)
    try:
        a = threading.Thread(target=session, args=("A", everything), name="A")
        a.start()
        assert a_held.wait(timeout=30)
        b = threading.Thread(target=session, args=("B", []), name="B")
        b.start()
        b.join(timeout=60)
        a.join(timeout=60)
    finally:
        handle.remove()
    assert set(results) == {"A", "B"} and not left_on_model
    torch.testing.assert_close(results["B"].explanation.logits, alone_b.logits)
    torch.testing.assert_close(results["B"].explanation.relevance, alone_b.relevance)
    assert "off" not in results["B"].summary
    torch.testing.assert_close(results["A"].explanation.logits, alone_a.logits)


def test_one_pass_of_the_model_per_input(explorer):
    """An input runs the model once, with the heads off and every head on in one batch;
    a new query patch, layer or matrix head, and the colour scale, redraw without it."""
    model, x = explorer.model, an_image(explorer)
    batches = []
    handle = model.patch_embed.register_forward_pre_hook(lambda m, i: batches.append(len(i[0])))
    try:
        e = explorer.explain(x, heads_off=[(1, 2)])
        assert batches == [2]
        batches.clear()
        explorer.view(x, heads_off=[(1, 2)], token=6, shared=True, explanation=e)
        explorer.query(e, x, layer=2, token=7, matrix_head=1)
        assert batches == []
    finally:
        handle.remove()


INFERNO_ENDS = (colormaps["inferno"]([0.0, 1.0])[:, :3] * 255).round().astype(np.uint8)
CROSS_RED = np.array([204, 26, 26], dtype=np.uint8)  # drawing.crossed_out's red


def has_colour_bar(picture: np.ndarray) -> bool:
    """A row that starts with the colour map's first colour and holds its last one."""
    first, last = INFERNO_ENDS
    return any((row[0] == first).all() and (row == last).all(-1).any() for row in picture)


def test_pictures_explain_themselves(explorer, page):
    x = an_image(explorer)
    view = explorer.view(x, heads_off=[(1, 2)], layer=1, matrix_head=0)
    for name in ("model_view", "query_view", "matrix", "rollout", "relevance"):
        assert has_colour_bar(getattr(view, name)), f"{name}: no colour bar"
    # A switched-off head is crossed out, in the model view and in its layer's query view.
    assert (view.model_view == CROSS_RED).all(-1).sum() > 100
    assert (view.query_view == CROSS_RED).all(-1).sum() > 100
    assert not (explorer.view(x).model_view == CROSS_RED).all(-1).any()
    # One scale for a whole panel, from 0 to its largest value, on request.
    shared = explorer.view(x, heads_off=[(1, 2)], layer=1, matrix_head=0, shared=True)
    assert not np.array_equal(shared.model_view, view.model_view)
    radio = components(page, "Radio")
    assert [c[1] for c in radio[0].choices] == ["each map", "shared"]
    notes = " ".join(str(m.value) for m in components(page, "Markdown"))
    assert "its own minimum and maximum" in notes and "from 0 to the panel's largest" in notes
    # Titles above the pictures (Gradio's label covers a picture's top left corner), and
    # a text for screen readers.
    pictures = components(page, "Image")
    assert len(pictures) == 7
    assert all(not p.show_label and len(p.alt_text or "") > 30 for p in pictures)


def test_what_each_head_writes_is_its_direct_logit_attribution(explorer):
    """The panel beside the model view: each head's direct logit attribution, the same as
    eval.py analysis=circuits computes; a head switched off writes nothing, and the rows
    then add up to the logits of the model with that head zeroed as eval.py does."""
    model, x = explorer.model, an_image(explorer)
    view = explorer.view(x)
    e = view.explanation
    torch.testing.assert_close(
        e.attribution, direct_logit_attribution(model, x).contributions[0], atol=1e-5, rtol=0
    )
    off = explorer.view(x, heads_off=[(1, 2)])
    with torch.no_grad(), heads_switched_off(model, [(1, 2)]):
        zeroed = model(x)[0]
    torch.testing.assert_close(off.explanation.attribution.sum(0), zeroed, atol=1e-4, rtol=0)
    grid = off.explanation.head_attribution(off.explanation.predicted)
    assert grid[1, 2] == 0 and grid.abs().sum() > 0
    assert not np.array_equal(off.writes, view.writes)
    # "Why not a 9?": the margin over the class asked about, else the runner-up.
    asked = explorer.view(x, target=(e.predicted + 1) % 10).explanation
    margin = asked.head_attribution(e.predicted, (e.predicted + 1) % 10)
    torch.testing.assert_close(
        margin, e.head_attribution(e.predicted) - e.head_attribution((e.predicted + 1) % 10)
    )
    # The lens: after the last block, the model's own probabilities.
    # The plot's lines keep their names from image to image: Gradio's line plot draws no
    # line whose name was not in its first picture.
    assert tuple(view.lens["line"].unique()) == explorer_module.LENS_LINES
    # Whole blocks on its axis (issue 102: a number axis ticked 0.5, 1.5, ...): the
    # blocks as labels, in the order the plot is told.
    blocks = [str(b) for b in range(len(model.blocks))]
    assert list(view.lens["after block"].unique()) == blocks
    last = view.lens[view.lens["after block"] == blocks[-1]]
    predicted = f"class {explorer.class_names[e.predicted]}"
    top = float(last[last["class"] == predicted]["probability %"].iloc[0])
    assert top == pytest.approx(100 * float(e.probs.max()), abs=1e-3)


def test_nothing_on_the_page_misleads_or_fetches(explorer, page, monkeypatch):
    import gradio
    from gradio import processing_utils

    (gallery,) = components(page, "Gallery")
    assert gallery.interactive is False  # not cleared, deleted from or uploaded to
    for kind in ("Image", "Gallery"):
        for component in components(page, kind):
            assert component.buttons is not None and "share" not in component.buttons
    assert page.delete_cache  # the files of uploads and drawings; tested in the browser
    # A change made while the last one is computed is shown after it; Gradio's default for
    # these events drops it, and the panels then disagree with the controls.
    updates = [f for f in page.fns.values() if f.fn is not None and f.name != "save_view"]
    assert len(updates) > 10 and {f.trigger_mode for f in updates} == {"always_last"}
    # A URL given as a file (an API request can) is refused, never fetched.
    fetched = []

    async def download(url, cache_dir):
        fetched.append(url)
        return str(Path(cache_dir) / "7.png")

    monkeypatch.setattr(processing_utils, "async_ssrf_protected_download", download)
    (upload,) = components(page, "File")
    with pytest.raises(gradio.Error, match="uploads only"):
        asyncio.run(upload.async_move_resource_to_block_cache("http://example.com/7.png"))
    assert components(page, "Sketchpad") == []  # the canvas sends its drawing, no file
    assert fetched == []


def test_refused_inputs_are_said_in_the_users_words(explorer, page, tmp_path, monkeypatch):
    fake = tmp_path / "fake.png"
    fake.write_text("not an image")
    with pytest.raises(ValueError) as error:
        explorer.from_file(fake)
    said = str(error.value)
    assert said.startswith("fake.png cannot be read as an image")
    assert str(tmp_path) not in said and "Error" not in said
    # The pixel count is checked on the header, before anything is decoded.
    big = tmp_path / "big.png"
    Image.new("L", (300, 300), 255).save(big)
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda image: decoded.append(image))
    small = dataclasses.replace(explorer, max_megapixels=0.05)
    with pytest.raises(ValueError, match=r"big.png has 300 x 300 pixels .* at most 0.05 mega"):
        small.from_file(big)
    assert decoded == []
    # An index out of range typed on the page reaches Explorer.from_test, which says the
    # range as a warning on the page; Gradio's own range check ends in a traceback.
    (number,) = components(page, "Number")
    assert number.preprocess(70_000) == 70_000
    # A drawing the canvas would not send (only an API call can) is a warning on the page.
    import gradio

    warned = []
    monkeypatch.setattr(gradio, "Warning", warned.append)
    (drawn,) = [f.fn for f in page.fns.values() if f.name == "drawn"]
    for sent in ({"png": "http://example.com/7.png"}, {"png": 7}, None):
        shown = drawn(gradio.EventData(None, sent), None)
        assert all(
            isinstance(update, dict) and update.get("__type__") == "update" for update in shown
        )
    assert len(warned) == 2 and all("PNG data URL" in w for w in warned), warned


def test_an_address_the_page_cannot_have_is_one_line(tmp_path, tiny_ckpt, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for setting, said in (
            (f"server_port={port}", f"server_port={port} is taken by another program"),
            ("server_name=8.8.8.8", "server_name=8.8.8.8 (8.8.8.8) is not an address of this"),
            ("server_name=no-such-host.invalid", "server_name=no-such-host.invalid does not"),
            ("server_name='::1'", "server_name=::1: an IPv6 address"),
        ):
            start = time.perf_counter()
            with pytest.raises(SystemExit) as e:
                main(explore_cfg(tmp_path, f"ckpt_path={tiny_ckpt}", setting))
            err = capsys.readouterr().err
            assert e.value.code == 2 and err.count("\n") == 1 and said in err, err
            assert time.perf_counter() - start < 10


def test_an_address_open_to_the_network_is_warned_about(tmp_path, tiny_ckpt, monkeypatch, caplog):
    class Served:  # the page, served and stopped at once
        def block_thread(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(server_module, "build_page", lambda explorer: Served())
    monkeypatch.setattr(server_module, "launch", lambda page, **kw: "http://localhost:7860/")
    for name, warned in (("0.0.0.0", True), ("127.0.0.1", False)):
        caplog.clear()
        main(explore_cfg(tmp_path, f"ckpt_path={tiny_ckpt}", f"server_name={name}"))
        assert ("open to every machine that can reach this one" in caplog.text) == warned


def test_save_this_view_writes_every_panel_and_its_settings(explorer, tmp_path):
    saving = dataclasses.replace(explorer, run_dir=tmp_path)
    x = an_image(explorer)
    chosen = {
        "heads_off": [(1, 2)],
        "target": 3,
        "layer": 2,
        "token": 6,
        "matrix_head": 1,
        "shared": True,
    }
    view = saving.view(x, source="test image 3", **chosen)
    path = saving.save(view, x)
    assert path == tmp_path / "views" / "view-001.png"
    assert saving.save(view, x).name == "view-002.png"
    with Image.open(path) as picture:
        assert picture.height > sum(
            getattr(view, n).shape[0] for n in ("model_view", "query_view", "matrix")
        )
    settings = json.loads(path.with_suffix(".json").read_text())
    assert settings["ckpt_path"] == explorer.title and settings["heads_off"] == ["1:2"]
    assert settings["colour_scale"] == "shared" and settings["source"] == "test image 3"
    # The settings reproduce the view, a drawing too (its pixels are saved).
    pixels = torch.tensor(settings["input_pixels"])[None]
    again = explorer.view(
        explorer.from_pixels(pixels),
        heads_off=[tuple(map(int, h.split(":"))) for h in settings["heads_off"]],
        target=settings["target"],
        layer=settings["layer"],
        token=settings["token"],
        matrix_head=settings["matrix_head"],
        shared=settings["colour_scale"] == "shared",
    )
    torch.testing.assert_close(again.explanation.logits, view.explanation.logits, atol=1e-3, rtol=0)
