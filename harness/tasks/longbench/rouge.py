"""ROUGE-L exactly as LongBench computes it: the ``rouge`` package's (pltrdy 1.0.1) summary level.

Its rules, which differ from ``rouge-score``'s rougeL:
* sentences are the pieces of ``text.split(".")`` that are not empty, whitespace collapsed, and
  words are ``sentence.split(" ")`` (case-sensitive, no stemming, no tokenizer);
* counts are of *distinct* words: m and n are the distinct words of reference and prediction, and
  the overlap is the number of distinct words in the union, over every (reference sentence,
  predicted sentence) pair, of one longest common subsequence, backtracked the package's way;
* F = 2PR / (P + R + 1e-8); no sentence on either side is an error that LongBench scores 0.
"""
from __future__ import annotations


def sentences(text: str) -> list[str]:
    return [" ".join(piece.split()) for piece in text.split(".") if piece]


def lcs_words(reference: list[str], predicted: list[str]) -> set[str]:
    """The words of one LCS of two word lists, backtracked as the rouge package does it
    (on a mismatch, step back in the reference only when that keeps a strictly longer LCS)."""
    rows, cols = len(reference), len(predicted)
    table = [[0] * (cols + 1) for _ in range(rows + 1)]
    for i in range(1, rows + 1):
        for j in range(1, cols + 1):
            if reference[i - 1] == predicted[j - 1]:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    words, i, j = set(), rows, cols
    while i and j:
        if reference[i - 1] == predicted[j - 1]:
            words.add(reference[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l_summary(prediction: str, reference: str) -> float:
    """LongBench's ``rouge_score``: the F of summary-level ROUGE-L, 0.0 where the package raises."""
    predicted, referenced = sentences(prediction), sentences(reference)
    if not predicted or not referenced:
        return 0.0
    predicted_words = [s.split(" ") for s in predicted]
    referenced_words = [s.split(" ") for s in referenced]
    union: set[str] = set()
    for ref in referenced_words:
        for pred in predicted_words:
            union |= lcs_words(ref, pred)
    m = len({w for s in referenced_words for w in s})
    n = len({w for s in predicted_words for w in s})
    recall, precision = len(union) / m, len(union) / n
    return 2.0 * (precision * recall) / (precision + recall + 1e-8)
