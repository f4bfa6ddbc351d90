"""The seed the Hugging Face test scripts draw their models and tokens from: fixed by default so
that every run (CI included) checks the same cases; --seed N or MEGATRAIN_HF_SEED picks another."""
import os

DEFAULT_SEED = 20240611
SEED_ENV = "MEGATRAIN_HF_SEED"


def add_seed_option(parser):
    parser.add_argument("--seed", type=int, default=None,
                        help=f"seed of the models and tokens (default: ${SEED_ENV} if set, else {DEFAULT_SEED})")


def resolve_seed(arg):
    """The seed to use: the --seed value, else $MEGATRAIN_HF_SEED, else DEFAULT_SEED.
    Raises ValueError when the variable is not an integer."""
    if arg is not None:
        return arg
    env = os.environ.get(SEED_ENV, "").strip()
    try:
        return int(env) if env else DEFAULT_SEED
    except ValueError:
        raise ValueError(f"{SEED_ENV}={env!r} is not an integer") from None
