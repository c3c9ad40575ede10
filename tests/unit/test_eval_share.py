"""The eval lane's share of a rollout worker's polls (``--eval-share``): it goes first, training prompts paused, in at
most that share of the polls it waits through, so a large held-out set cannot hold the trainer idle."""
from rlstream.stages.rollout import eval_goes_first


def test_the_eval_lane_goes_first_in_at_most_its_share_of_the_polls_it_waits_through():
    def lane(share: float, polls: int) -> list[bool]:
        first, out = 0, []
        for waited in range(polls):
            out.append(eval_goes_first(first, waited, share))
            first += out[-1]
        return out

    assert lane(1.0, 5) == [True] * 5  # the old rule: always first
    assert lane(0.5, 6) == [True, False, True, False, True, False]
    assert sum(lane(0.25, 100)) == 25 and lane(0.25, 2)[0]  # the first poll always goes to it
