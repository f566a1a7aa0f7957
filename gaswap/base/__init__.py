"""The torch-free floor every other package stands on: the program vocabulary (`program`), files and atomic
writes (`files`), units, signals, locating experiment files (`locate`), the options of a training step
(`training_options`), the experiment schema (`config`) and the exception hierarchy (`errors`).
Imports nothing of gaswap outside `base`, and never torch."""
