"""What a user hands the trainer, before anything is built: the datasets and their checks.

`checks` refuses what cannot train (a missing prompt column, a `DatasetDict`, too few prompts, options episodes cannot
take); `streaming` serves a streamed dataset (`IterableDataset`) in the sampler's order, one slice per process.
"""
