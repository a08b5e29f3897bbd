from moemesh.engine.speculative.ngram import NgramProposer


def test_repeated_phrase_is_drafted_from_its_earlier_occurrence():
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    proposal = NgramProposer(min_n=2, max_n=3).propose_one(tokens, 3)
    assert proposal.token_ids == [8, 9, 1]
    # one voter, match length 3: (1 + 1) / (1 + 2) * 3 / 4 = 0.5 for each draft
    assert proposal.confidences == [0.5, 0.5, 0.5]


def test_majority_vote_and_confidence_grow_with_agreement():
    tokens = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]
    proposal = NgramProposer(min_n=2, max_n=2).propose_one(tokens, 2)
    assert proposal.token_ids == [3, 1]
    c0, c1 = proposal.confidences
    assert c0 == (2 + 1) / (3 + 2) * 2 / 3  # 2 of 3 earlier "1 2" were followed by 3
    assert c1 == (2 + 1) / (2 + 2) * 2 / 3  # both voters left agree on the next token


def test_no_match_means_no_proposal():
    assert NgramProposer().propose_one([1, 2, 3, 4, 5], 4) is None
    assert NgramProposer().propose({"a": [1, 2, 3], "b": [7, 7, 7, 7]}, 2) == {
        "b": NgramProposer().propose_one([7, 7, 7, 7], 2)
    }
