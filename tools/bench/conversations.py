#!/usr/bin/env python3
"""Writes assets/bench/conversations.json: a small multi-turn conversation set in ShareGPT
format for `pdctl bench --workload conversation` (nothing can be downloaded, so the repository
ships its own). Deterministic: the same seed writes the same bytes. Standard library only.

    python3 tools/bench/conversations.py [--seed 0] [--count 24] [--out assets/bench/conversations.json]
"""

import argparse
import json
import random

TOPICS = [
    ("a vegetable garden", ["tomatoes", "soil", "watering", "compost", "seedlings", "sunlight"]),
    ("learning the piano", ["scales", "practice", "sight reading", "chords", "posture", "tempo"]),
    ("a trip to the mountains", ["trail", "weather", "tent", "altitude", "map", "boots"]),
    ("baking bread", ["flour", "yeast", "kneading", "oven", "crust", "proofing"]),
    ("a small software project", ["tests", "bugs", "design", "deadline", "review", "release"]),
    ("training for a marathon", ["mileage", "rest days", "shoes", "pace", "hydration", "injury"]),
    ("keeping bees", ["hive", "queen", "honey", "swarm", "smoke", "winter"]),
    ("writing a short story", ["plot", "character", "dialogue", "ending", "draft", "voice"]),
    ("moving to a new city", ["rent", "neighbourhood", "transport", "friends", "boxes", "budget"]),
    ("repairing an old bicycle", ["chain", "brakes", "gears", "tyres", "frame", "rust"]),
    ("studying the night sky", ["telescope", "planets", "moon", "stars", "clouds", "charts"]),
    ("starting a book club", ["members", "schedule", "novels", "snacks", "discussion", "venue"]),
]

QUESTIONS = [
    "I am thinking about {topic}. Where should I start with the {a}?",
    "What is the most common mistake people make with the {a} when it comes to {topic}?",
    "How much time should I spend on the {a} compared with the {b}?",
    "Could you explain how the {a} and the {b} affect each other?",
    "Is there a simple routine for the {a} that a beginner can follow every week?",
    "What would you change about the {a} if the {b} went badly?",
    "Can you summarise what we said so far about the {a} in a few points?",
]

ANSWERS = [
    "Start small with the {a}: pick one thing to improve, watch it for a week, and write down "
    "what changed. With {topic} most progress comes from steady habits rather than big plans.",
    "People often ignore the {a} until it causes trouble. Check it early, keep notes, and "
    "compare with the {b}, because the two usually move together.",
    "Spend roughly twice as long on the {a} as on the {b} at first. Once the {a} feels "
    "routine, shift the balance and let the {b} take more of your attention.",
    "The {a} sets the limits for the {b}. When the {a} is in good shape the {b} becomes "
    "easier to manage, and when it is neglected every other part of {topic} suffers.",
    "Yes: on the first day look at the {a}, on the third day adjust the {b}, and at the end "
    "of the week write a short note about what worked. Repeat it for a month.",
    "I would simplify the {a}, remove anything that is not clearly helping, and give the "
    "{b} a second try with smaller steps before changing anything else.",
    "So far: the {a} comes first, the {b} follows from it, small regular steps beat large "
    "irregular ones, and notes make it easy to see what helps with {topic}.",
]


def conversation(rng, index):
    topic, things = TOPICS[index % len(TOPICS)]
    turns = []
    if rng.random() < 0.3:
        turns.append({"from": "system", "value": "You are a patient and practical assistant."})
    for _ in range(rng.randint(2, 5)):
        a, b = rng.sample(things, 2)
        q = rng.randrange(len(QUESTIONS))
        turns.append({"from": "human", "value": QUESTIONS[q].format(topic=topic, a=a, b=b)})
        # Answers of one to three paragraphs, so reply lengths vary.
        paragraphs = [
            ANSWERS[(q + k) % len(ANSWERS)].format(topic=topic, a=a, b=b)
            for k in range(rng.randint(1, 3))
        ]
        turns.append({"from": "gpt", "value": "\n\n".join(paragraphs)})
    return {"id": f"conv-{index:03d}", "conversations": turns}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=24)
    parser.add_argument("--out", default="assets/bench/conversations.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    data = [conversation(rng, i) for i in range(args.count)]
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
