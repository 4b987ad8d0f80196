"""The shapes classifier and the Frechet distance on its features (ppdiffusers_tome/shapes/classifier.py): the
distance against closed forms and an independent numpy reference, the network's outputs, a short training that
lowers its loss, and a save/load round trip."""

import numpy as np
import paddle
import pytest

from research.shapes import classifier, dataset
from research.shapes.classifier import (
    FEATURES,
    HEADS,
    ShapesClassifier,
    extract_features,
    feature_statistics,
    frechet_distance,
    load_classifier,
    predict,
    save_classifier,
    train_classifier,
)


def random_features(seed=0, count=400, dim=6):
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(dim, dim))
    return rng.normal(size=(count, dim)) @ mixing + rng.normal(size=dim)


def reference_distance(mean1, cov1, mean2, cov2):
    """FID's formula with tr((cov1 cov2)^(1/2)) from the eigenvalues of the (non-symmetric) product, in float64."""
    eigenvalues = np.linalg.eigvals(cov1 @ cov2)
    return float(((mean1 - mean2) ** 2).sum() + np.trace(cov1) + np.trace(cov2)
                 - 2.0 * np.sqrt(np.clip(eigenvalues.real, 0, None)).sum())


def test_distance_of_a_set_to_itself_is_zero():
    mean, cov = feature_statistics(random_features())
    assert frechet_distance(mean, cov, mean, cov) == pytest.approx(0.0, abs=1e-9)


def test_distance_to_a_shifted_copy_is_the_squared_shift():
    features = random_features()
    shift = np.array([0.5, -1.0, 2.0, 0.0, 0.25, -3.0])
    first = feature_statistics(features)
    second = feature_statistics(features + shift)
    assert frechet_distance(*first, *second) == pytest.approx(float((shift**2).sum()), rel=1e-9)


def test_distance_between_diagonal_gaussians_has_its_closed_form():
    a, b = np.array([1.0, 4.0, 0.25]), np.array([9.0, 1.0, 0.25])
    mean1, mean2 = np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, 0.0])
    expected = ((mean1 - mean2) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum()  # 5 + 4 + 1
    assert frechet_distance(mean1, np.diag(a), mean2, np.diag(b)) == pytest.approx(expected, rel=1e-12)


def test_distance_matches_an_independent_reference_and_is_symmetric():
    first = feature_statistics(random_features(0))
    second = feature_statistics(random_features(1))
    distance = frechet_distance(*first, *second)
    assert distance > 1.0
    assert distance == pytest.approx(reference_distance(*first, *second), rel=1e-8)
    assert distance == pytest.approx(frechet_distance(*second, *first), rel=1e-9)


def test_statistics_are_float64_mean_and_unbiased_covariance():
    features = random_features().astype(np.float32)
    mean, cov = feature_statistics(features)
    assert mean.dtype == cov.dtype == np.float64
    centred = features.astype(np.float64) - features.astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(cov, centred.T @ centred / (len(features) - 1), rtol=1e-10)
    with pytest.raises(ValueError, match=r"features must be \[N, D\] with N >= 2"):
        feature_statistics(features[:1])
    with pytest.raises(ValueError, match="means must be"):
        frechet_distance(mean, cov, mean[:3], cov[:3, :3])


def test_network_outputs_features_and_one_logit_row_per_head():
    paddle.seed(0)
    model = ShapesClassifier()
    model.eval()
    images, _, _ = dataset.batch(range(3), seed=0)
    features = extract_features(model, images)
    assert features.shape == (3, FEATURES) and features.dtype == np.float64
    predictions = predict(model, images)
    for name, count in HEADS.items():
        assert predictions[name].shape == (3,) and predictions[name].max() < count
    with pytest.raises(ValueError, match=r"images must be \[N, 3, H, W\]"):
        predict(model, images[0])


def held_out_loss(model):
    images, _, targets = dataset.batch(range(64), seed=3)
    model.eval()
    with paddle.no_grad():
        return float(classifier._loss(model(paddle.to_tensor(images))[1], targets))


def test_short_training_lowers_the_loss_and_the_weights_round_trip(tmp_path):
    paddle.seed(0)
    untrained = ShapesClassifier()  # the weights train_classifier starts from
    model, log = train_classifier(minutes=1.0, max_steps=12, batch_size=16, seed=0)
    assert len(log["loss"]) == 12 and all(np.isfinite(log["loss"]))
    assert held_out_loss(model) < 0.8 * held_out_loss(untrained)
    accuracy = classifier.evaluate(model, count=64, seed=3)
    assert set(accuracy) == set(HEADS) and all(0.0 <= v <= 1.0 for v in accuracy.values())
    assert accuracy["background"] > 0.5  # 6 classes: chance is 1/6; learnt first
    path = str(tmp_path / "clf.pdparams")
    save_classifier(model, path, {"accuracy": accuracy})
    loaded = load_classifier(path)
    images, _, _ = dataset.batch(range(8), seed=5)
    np.testing.assert_allclose(extract_features(loaded, images), extract_features(model, images), atol=1e-6)
    with pytest.raises(ValueError, match="path must be a classifier"):
        load_classifier(str(tmp_path / "missing.pdparams"))


def test_accuracy_counts_known_targets_only():
    paddle.seed(0)
    model = ShapesClassifier()
    images, _, _ = dataset.batch(range(4), seed=0)
    predicted = predict(model, images)
    targets = {name: predicted[name].copy() for name in HEADS}
    targets["shape"][:2] = (targets["shape"][:2] + 1) % HEADS["shape"]  # two wrong
    targets["colour"][0] = -1  # not counted
    targets["position"][:] = -1
    result = classifier.accuracy(model, images, targets)
    assert result["shape"] == 0.5 and result["colour"] == 1.0 and result["background"] == 1.0
    assert np.isnan(result["position"])


def test_feature_distance_is_zero_for_the_same_images_and_grows_with_a_shift():
    paddle.seed(0)
    model = ShapesClassifier()
    images, _, _ = dataset.batch(range(40), seed=0)
    other, _, _ = dataset.batch(range(40, 80), seed=0)
    assert classifier.feature_distance(model, images, images) == pytest.approx(0.0, abs=1e-6)
    same_kind = classifier.feature_distance(model, images, other)
    darker = classifier.feature_distance(model, images, np.clip(other - 0.5, -1, 1))
    assert 0.0 < same_kind < darker
