"""The training prompts' batches: each epoch's short last batch is cut to a multiple of the data-parallel replicas."""

import pytest

from nemo_jq.recipe.state import Course, PromptStream, TrainState
from nemo_jq.runtime.distributed import batches_per_epoch


def epochs_of(prompts: int, batch_size: int, replicas: int, epochs: int = 3) -> list[list[list[int]]]:
    """The batches (prompt ids) :class:`PromptStream` gives over ``epochs``, epoch by epoch, as many as
    :func:`batches_per_epoch` says an epoch holds."""
    stream, state = PromptStream(list(range(prompts)), batch_size, seed=5, replicas=replicas), TrainState(Course("garl"))
    out = []
    for _ in range(epochs):
        epoch = [stream.next(state) for _ in range(batches_per_epoch(prompts, batch_size, replicas))]
        out.append(epoch)
    return out


@pytest.mark.parametrize("prompts, batch_size, replicas, sizes", [
    (24, 4, 1, [4] * 6), (7, 4, 1, [4, 3]), (7, 4, 2, [4, 2]), (5, 4, 2, [4]), (13, 8, 4, [8, 4]), (3, 4, 2, [2])])
def test_each_epoch_is_its_permutations_batches_the_last_cut_to_a_multiple_of_the_replicas(prompts, batch_size, replicas,
                                                                                          sizes):
    alone = epochs_of(prompts, batch_size, 1)
    for epoch, whole in zip(epochs_of(prompts, batch_size, replicas), alone):
        assert [len(batch) for batch in epoch] == sizes
        assert len({i for batch in epoch for i in batch}) == sum(sizes)  # no prompt twice in an epoch
        assert [batch == full[:len(batch)] for batch, full in zip(epoch, whole)] == [True] * len(sizes)  # one order
    assert alone[0] != alone[1]  # a new permutation each epoch


def test_the_batch_asked_for_ahead_is_the_next_one_across_a_skipped_batch():
    """One step off, the next step's batch is requested a step early: across an epoch's end whose short batch is
    skipped, it is still the batch the next step takes."""
    stream, state = PromptStream(list(range(5)), 4, seed=5, replicas=2), TrainState(Course("garl"))
    for _ in range(4):
        upcoming = stream.upcoming(state)
        assert stream.next(state) == upcoming and len(upcoming) == 4
