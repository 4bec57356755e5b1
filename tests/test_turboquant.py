"""TurboQuant's numpy codec (sharpi.common.kv_codecs.turboquant) against the paper's figures (arXiv 2504.19874,
Theorems 1 and 2), on random unit vectors at d = 64 and 128 and 2 to 4 bits.

The paper prints D_mse ~ 0.36, 0.117, 0.03, 0.009 for b = 1..4 and D_prod ~ 1.57/d, 0.56/d, 0.18/d, 0.047/d: these
are Lloyd-Max's distortions of a Gaussian coordinate (0.3634, 0.1175, 0.03454, 0.009497; a coordinate of a random
unit vector tends to N(0, 1/d)) and pi/2 times the one of a bit less, rounded. Rounded, 0.03 and 0.047 sit 13% under
what they round (0.0345, 0.0543), so the bounds here are the unrounded figures; the printed ones are checked where
they are within their rounding (b = 2 MSE and b = 2, 3 inner-product variance)."""
import math

import numpy as np
import pytest

from sharpi.common.errors import ConfigError
from sharpi.common.kv_codecs.turboquant import (TurboQuant, TurboQuantProd, codebook, pack_planes, rotate,
                                                unpack_planes, unrotate)

LLOYD_MAX_GAUSSIAN = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}
PAPER_MSE = {2: 0.117, 3: 0.03, 4: 0.009}
PAPER_PROD = {2: 0.56, 3: 0.18, 4: 0.047}          # times 1/d


def unit_vectors(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def rotation_matrix(dim: int) -> np.ndarray:
    """Pi as a dense f32 [dim, dim] (row i: what coordinate i of Pi x takes of x)."""
    return rotate(np.eye(dim, dtype=np.float32)).T.copy()


def test_rotation_is_orthonormal_and_the_planes_round_trip():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 128)).astype(np.float32)
    np.testing.assert_allclose(unrotate(rotate(x)), x, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(rotate(x), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(rotate(x), x @ rotation_matrix(128).T, atol=1e-5)
    codes = rng.integers(0, 8, (3, 64)).astype(np.uint8)
    np.testing.assert_array_equal(unpack_planes(pack_planes(codes, 3), 3), codes)
    assert pack_planes(codes, 3).shape == (3, 6)                   # 3 bits x 64 coordinates: six words
    c, t = codebook(3, 64)
    assert len(c) == 8 and len(t) == 7 and np.all(np.diff(c) > 0) and np.allclose(c, -c[::-1], atol=1e-6)
    with pytest.raises(ConfigError, match="power of two"):
        TurboQuant(3).check(96, 16)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_matches_the_papers_distortion(bits, d):
    """E|x - Q(x)|^2 over 20,000 random unit vectors within 10% of Lloyd-Max's figure (measured 2-4% under it:
    the sphere's coordinate has lighter tails than the Gaussian it tends to)."""
    x = unit_vectors(np.random.default_rng(bits * 100 + d), 20000, d)
    tq = TurboQuant(bits)
    q, n = tq.quantize(None, x)
    mse = ((tq.dequantize(None, q, n) - x) ** 2).sum(-1).mean()
    assert abs(mse / LLOYD_MAX_GAUSSIAN[bits] - 1) < 0.10, mse
    if bits != 3:
        assert abs(mse / PAPER_MSE[bits] - 1) < 0.10, mse
    np.testing.assert_allclose(n[..., 0], math.sqrt(d), rtol=1e-5)    # |H s x| = sqrt(d) |x|, kept apart


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_inner_product_variant_is_unbiased_within_its_variance(bits, d):
    """Over 10^5 pairs (200 sketches of 500 pairs: the estimator is unbiased over the sketch G): the mean error of
    <q, x> below 1e-3 of the mean |<q, x>| for queries correlated with the keys (<q, x> ~ 0.8, where the MSE
    quantizer alone is biased by about D_mse), and the variance for independent unit queries within 10% of pi/2
    D_mse(bits - 1) / d, the bound the paper's figures round."""
    rng = np.random.default_rng(bits * 1000 + d)
    errors, truths, independent, mse_only = [], [], [], []
    for g in range(200):
        prod = TurboQuantProd(bits, d, seed=g)
        k, n = unit_vectors(rng, 500, d), unit_vectors(rng, 500, d)
        q = 0.8 * k + 0.6 * n
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
        quantized = prod.quantize(k)
        truth = (q * k).sum(-1)
        errors.append(prod.inner_products(q, quantized) - truth)
        mse_only.append((q * quantized[0]).sum(-1) - truth)
        truths.append(truth)
        independent.append(prod.inner_products(n, quantized) - (n * k).sum(-1))
    errors, truths = np.concatenate(errors), np.concatenate(truths)
    scale = np.abs(truths).mean()
    assert abs(errors.mean()) < 1e-3 * scale
    assert abs(np.concatenate(mse_only).mean()) > 10e-3 * scale          # what the QJL stage removes
    variance = np.concatenate(independent).var() * d
    assert abs(variance / (math.pi / 2 * LLOYD_MAX_GAUSSIAN[bits - 1]) - 1) < 0.10, variance
    if bits != 4:
        assert abs(variance / PAPER_PROD[bits] - 1) < 0.10, variance
