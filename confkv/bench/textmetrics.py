"""Text overlap between a policy's free generations and the full cache's generations of the same prompts.

Perplexity and KL only see teacher-forced tokens; these scores catch what a smaller cache does to free text once the
first differing token sends the generation down another path. The full cache is the reference, so identical text
scores 100 (BLEU-4) and 1.0 (ROUGE-L).
"""

from __future__ import annotations

from collections.abc import Sequence


def _check_pairs(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    """Fail loudly: an empty or misaligned corpus would otherwise give a meaningless score that looks real."""
    if not hypotheses or not references:
        raise ValueError("need at least one hypothesis and one reference")
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references; they pair up one to one")


def bleu4(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU-4 (sacrebleu defaults), 0-100.

    Identical corpora score exactly 100: sacrebleu gives 0 to a corpus with no 4-grams at all (all texts under four
    tokens), which would rank the full cache against itself as worst.
    """
    import sacrebleu

    _check_pairs(hypotheses, references)
    if list(hypotheses) == list(references):
        return 100.0
    score = sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score
    return float(min(100.0, max(0.0, score)))


def rouge_l(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Mean ROUGE-L F1 over the pairs (stemmed), 0-1.

    A pair of identical texts scores 1.0 even when both are empty (an early EOS in both): rouge_score would give 0.
    """
    from rouge_score import rouge_scorer

    _check_pairs(hypotheses, references)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    total = 0.0
    for hyp, ref in zip(hypotheses, references, strict=True):
        total += 1.0 if hyp == ref else scorer.score(ref, hyp)["rougeL"].fmeasure
    return total / len(hypotheses)
