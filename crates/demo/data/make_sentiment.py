"""Writes sentiment.jsonl: short product reviews written for this project,
each labelled with the rating 1 (very negative) to 5 (very positive) that its
wording was composed to express. Deterministic: run it again for the same file.
"""
import json
import random

THINGS = ["phone", "hotel", "restaurant", "movie", "laptop", "book", "pair of headphones", "coffee maker", "airline", "game"]
PHRASES = {
    1: ["It broke on the first day and support never answered.", "Worst purchase I have ever made.", "Rude staff, dirty rooms, and a refund was refused.",
        "Completely unusable and a total waste of money.", "I want my money back; this was a disaster."],
    2: ["It works, but poorly, and I regret buying it.", "Disappointing quality for the price.", "Several problems made it frustrating to use.",
        "Below my expectations in almost every way.", "Not terrible, but I would not recommend it."],
    3: ["It is okay, nothing special either way.", "Average overall, some good parts and some bad.", "It does the job, no more and no less.",
        "Mixed feelings: decent but forgettable.", "Neither good nor bad, just fine."],
    4: ["Pretty good, with only a few small issues.", "I liked it and would probably buy it again.", "Solid quality and a fair price.",
        "Works well; a couple of minor annoyances.", "A good experience overall."],
    5: ["Absolutely loved it, perfect in every way!", "The best I have ever had, highly recommended!", "Outstanding quality and wonderful service.",
        "Exceeded all my expectations, simply amazing.", "Fantastic! I would give it ten stars if I could."],
}

rng = random.Random(20261129)
rows = []
for rating, phrases in PHRASES.items():
    for i in range(20):
        thing = THINGS[(i * 3 + rating) % len(THINGS)]
        text = f"This {thing}: {phrases[i % len(phrases)]}"
        rows.append({"text": text, "label": rating})
rng.shuffle(rows)
with open("sentiment.jsonl", "w") as f:
    for row in rows:
        f.write(json.dumps(row) + "\n")
print(len(rows), "reviews")
