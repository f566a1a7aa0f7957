"""Tiny models and the set of policies the runtime tests run them under (CPU, seconds)."""
from torch import nn

from gaswap import zoo
from gaswap.plan.encoding import Action
from gaswap.run.capture import capture


class PreNormEncoder(nn.Module):
    """A ViT-style block: pre-norm `nn.TransformerEncoderLayer` with dropout (its residual dropout after
    attention reads a non-contiguous tensor), mean over the tokens, a linear head."""

    def __init__(self, width: int = 16, classes: int = 5):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.3, batch_first=True, norm_first=True)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


MODELS = {  # name -> (factory, input specs, target spec): BatchNorm, residual and dropout; a GPT; an MLP; a ViT block
    "cnn": (lambda: zoo.tiny_cnn(num_classes=10, width=8), [{"shape": ["batch", 3, 16, 16]}],
            {"shape": ["batch"], "dtype": "int64", "high": 10}),
    "gpt": (lambda: zoo.gpt(vocab=50, layers=2, width=32, heads=4, seq=8, dropout=0.1),
            [{"shape": ["batch", 8], "dtype": "int64", "high": 50}], {"shape": ["batch", 8], "dtype": "int64", "high": 50}),
    "mlp": (lambda: zoo.mlp(sizes=(12, 32, 32, 5), dropout=0.2), [{"shape": ["batch", 12]}],
            {"shape": ["batch"], "dtype": "int64", "high": 5}),
    "encoder": (PreNormEncoder, [{"shape": ["batch", 6, 16]}], {"shape": ["batch"], "dtype": "int64", "high": 5}),
}


def policy_set(encoding, shuffled, mixed) -> dict:
    """keep-all, swap-all, recompute-all (captured order), everything kept in `shuffled`'s order, and `mixed`
    (order and actions): name -> (order, actions)."""
    keep = encoding.uniform(Action.KEEP)
    return {
        "keep": (encoding.decode(keep.keys), keep.actions),
        "swap": (encoding.decode(keep.keys), encoding.uniform(Action.SWAP).actions),
        "recompute": (encoding.decode(keep.keys), encoding.uniform(Action.RECOMPUTE).actions),
        "reordered": (encoding.decode(shuffled.keys), keep.actions),
        "mixed": (encoding.decode(mixed.keys), mixed.actions),
    }


def classifier_capture(model, inputs, target, loss="cross_entropy", **options):
    """`capture` of a classifier's step: the tests that call this mean cross entropy and SGD with momentum where
    they name no loss or optimizer (capture's own defaults are the experiment file's: sum, plain SGD)."""
    return capture(model, inputs, target, loss, **{"optimizer": "sgd_momentum"} | options)
