"""The demo's tasks: questions about a word's letters, and counting. Each answer follows from the question alone, so a
model that learned the task answers words it never saw; the held-out set (val.json) is made of words and number ranges
that neither the base model's pretraining nor the fine-tuning data contains.

    Reverse the word. happy            -> yppah
    Uppercase the word. happy          -> HAPPY
    Repeat the word twice. happy       -> happy happy
    Spell the word. happy              -> h a p p y
    What is the last letter of the word? happy -> y
    Count from 3 to 7.                 -> 3 4 5 6 7
"""
from __future__ import annotations

import random
import string
from typing import Callable

WORD_TASKS: dict[str, Callable[[str], str]] = {
    "Reverse the word.": lambda w: w[::-1],
    "Uppercase the word.": str.upper,
    "Repeat the word twice.": lambda w: f"{w} {w}",
    "Spell the word.": " ".join,
    "What is the last letter of the word?": lambda w: w[-1],
}
COUNT = "Count from"  # "Count from 3 to 7." (no input)
INSTRUCTIONS = (*WORD_TASKS, COUNT)  # one token each in the demo tokenizer; every other character is its own token
COUNT_STARTS, COUNT_SPANS = range(1, 31), range(2, 7)  # from a to a + span
WORD_LENGTHS = range(3, 7)  # of the random letter strings the base is pretrained on

WORDS = sorted(set("""
able acid aged arch army atom aunt baby back bake band bank barn base bath beam bean bear beef bell belt bench bike
bird black blue boat body bone book boot bowl brave bread brick bride brush bunch cabin cake calm camel camp candy
card cart castle chair chalk cheese chess chin city clay clock cloud coat coin cold comb cook cool corn cotton couch
crab crow crown cube cup dance desk dish dog doll door dove dream dress drum duck dust eagle earth egg elbow fair farm
feast fence field film fire fish flag flame flute foam fog food foot forest fork fox frog fruit game garden gate gift
glass glove goat gold grape grass green guest hair hall hammer hand harp hat hawk heart hill hive home honey hook horn
horse house ice inch ink iron jacket jam jar jelly jewel juice kettle key king kite knee knife lace lake lamb lamp leaf
lemon lily lion lock lunch map maple market mask meal melon milk mint mirror moon moss mouse mouth mud nail nest net
night noon nose nut oak ocean olive onion orange owl paint palm pan paper park pear pearl pen pencil pepper piano pig
pillow pine pink pipe plate plum pond pony pool potato puppy queen quilt rabbit rain rice ring river road robin rock
roof room rope rose ruby rug salt sand scarf seal seed shark sheep shell ship shirt shoe silk silver sink skirt sky
sled smile snail snake snow soap sock sofa song soup spoon star stone storm straw sugar sun swan table tail tea tent
tiger toast tooth towel tower town toy train tree truck tulip turtle valley van vase violin wagon wall water wave
whale wheat wheel wind window wing wolf wood wool yard yarn zebra zoo
""".split()))


def record(instruction: str, input: str, output: str) -> dict:
    return {"instruction": instruction, "input": input, "output": output}


def word_question(instruction: str, word: str) -> dict:
    return record(instruction, word, WORD_TASKS[instruction](word))


def count_question(start: int, end: int) -> dict:
    return record(f"{COUNT} {start} to {end}.", "", " ".join(map(str, range(start, end + 1))))


def as_plain_text(r: dict) -> tuple[str, str]:
    """(question, answer) as the base model is pretrained on them: `Reverse the word. happy=`, `yppah`. The fine-tuning
    data asks the same in the instruction format (`Reverse the word.\\nhappy\\n` -> `yppah`): the same tokens at the
    same places but for the two separators, which is what the adapter has to learn."""
    return " ".join(x for x in (r["instruction"], r["input"]) if x) + "=", r["output"]


def split(seed: int, held_out_words: int = 50, per_task: int = 10, train_per_task: int = 70) -> tuple[list, list]:
    """(train, held out) records: the held-out ones ask `per_task` questions of each task about words (and number
    ranges) that no training record has."""
    rng = random.Random(seed)
    words = list(WORDS)
    rng.shuffle(words)
    held, rest = words[:held_out_words], words[held_out_words:]
    ranges = [(a, a + s) for a in COUNT_STARTS for s in COUNT_SPANS]
    rng.shuffle(ranges)
    val = [word_question(i, w) for i in WORD_TASKS for w in rng.sample(held, per_task)]
    train = [word_question(i, w) for i in WORD_TASKS for w in rng.sample(rest, train_per_task)]
    val += [count_question(a, b) for a, b in ranges[:per_task]]
    train += [count_question(a, b) for a, b in ranges[per_task:per_task + train_per_task]]
    rng.shuffle(train)
    rng.shuffle(val)
    return train, val


def random_question(rng: random.Random, avoid: set[str], avoid_ranges: set[tuple[int, int]]) -> dict:
    """A question of a random task about a random letter string (or number range), none of `avoid` (the held-out
    words) or `avoid_ranges`: what the demo base is pretrained on, so it learns the tasks rather than the words."""
    task = rng.randrange(len(INSTRUCTIONS))
    if INSTRUCTIONS[task] == COUNT:
        while (span := (a := rng.choice(COUNT_STARTS), a + rng.choice(COUNT_SPANS))) in avoid_ranges:
            pass
        return count_question(*span)
    while (word := "".join(rng.choices(string.ascii_lowercase, k=rng.choice(WORD_LENGTHS)))) in avoid:
        pass
    return word_question(INSTRUCTIONS[task], word)


def count_range(r: dict) -> tuple[int, int] | None:
    """(a, b) of a counting record, None for the others."""
    if not r["instruction"].startswith(COUNT):
        return None
    a, _, b = r["instruction"][len(COUNT):].strip(" .").partition(" to ")
    return int(a), int(b)
