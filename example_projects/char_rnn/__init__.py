"""char_rnn: a character-level LSTM (or GRU) on the docstrings of standard-library modules, trained with plain SGD,
with BNP (at batch 32 and online at batch 1) or with Adam; logs bits per character.

Run: ``python -m example_projects.char_rnn fit --config example_projects/char_rnn/configs/lstm_bnp_b32.yaml``
"""

from example_projects.char_rnn.model import CharRNNModule, CharTextDataModule

__all__ = ["CharRNNModule", "CharTextDataModule"]
