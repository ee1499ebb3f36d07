"""A seeded multi-hop world: entities and relations written as encyclopedia-style passages, with
distractors, and bridge / comparison questions of 2-4 hops over them (the offline stand-in for
HotpotQA's Wikipedia; the same loaders, index and agent run on both).

Relations: a work (film, novel, album) has a creator (director, author, producer); a
person was born in a city and studied at a university; a university is in a city; a city is in a
country. Questions follow chains of them:

- 2 hops, bridge:      "Where was the director of <film> born?"         (work -> person -> city)
                       "Which university did the author of <novel> attend?"
- 3 hops, bridge:      "In which country was the author of <novel> born?" (... -> city -> country)
- 4 hops, bridge:      "In which country is the university attended by the producer of <album>?"
- 2 hops, comparison:  "Which was released first, <work A> or <work B>?"

Every hop is one passage, found by searching the name the previous passage gave; distractor
passages mention the same names in other contexts, so a search must be specific.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from agent_r1.retrieval.corpus import Passage

_ON = ["ka", "ve", "lo", "ri", "ta", "mo", "sel", "dar", "fen", "gor", "hal", "jun", "ker", "lin", "mar",
       "nor", "pel", "quin", "ros", "tal", "ul", "vin", "wes", "yor", "zan", "bel", "cor", "dun", "el", "fir"]  # fmt: skip
_CODA = ["a", "o", "en", "is", "an", "or", "el", "ik", "us", "ith"]
COUNTRIES = ["Aldoria", "Brevania", "Cordisia", "Dunmark", "Estovia", "Feralia", "Galtia", "Hesperon"]
WORKS = {"film": ("directed by", "director"), "novel": ("written by", "author"), "album": ("produced by", "producer")}  # fmt: skip


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_ON) for _ in range(parts)) + rng.choice(_CODA)


@dataclass
class World:
    countries: list[str]
    cities: dict[str, str] = field(default_factory=dict)  # city -> country
    universities: dict[str, str] = field(default_factory=dict)  # university -> city
    people: dict[str, dict[str, object]] = field(default_factory=dict)  # name -> {born, city, university}
    works: dict[str, dict[str, object]] = field(default_factory=dict)  # title -> {kind, year, creator}

    def passages(self) -> list[Passage]:
        """Names are quoted, as titles are in encyclopedia prose; so a name is the same token
        sequence in a passage, a question, a search query and an answer."""
        out: list[Passage] = []
        for city, country in self.cities.items():
            out.append(Passage(f"city:{city}", city, f'"{city}" is a city in "{country}".'))
        for uni, city in self.universities.items():
            out.append(Passage(f"uni:{uni}", uni, f'"{uni}" is a university located in "{city}".'))
        for name, p in self.people.items():
            out.append(
                Passage(f"person:{name}", name, f'"{name}" was born in "{p["city"]}" in {p["born"]} and studied at "{p["university"]}".')
            )  # fmt: skip
        for title, w in self.works.items():
            verb = WORKS[str(w["kind"])][0]
            out.append(
                Passage(
                    f"work:{title}", title, f'"{title}" is a {w["year"]} {w["kind"]} {verb} "{w["creator"]}".'
                )
            )
        for i, d in enumerate(self.distractors):
            out.append(Passage(f"note:{i}", d[0], d[1]))
        return out

    distractors: list[tuple[str, str]] = field(default_factory=list)


def make_world(
    seed: int = 0, people: int = 60, works: int = 240, cities: int = 16, universities: int = 8
) -> World:
    rng = random.Random(seed)
    used: set[str] = set()

    def fresh(parts: int) -> str:
        while True:
            n = _name(rng, parts).capitalize()
            if n not in used:
                used.add(n)
                return n

    w = World(list(COUNTRIES))
    for _ in range(cities):
        w.cities[fresh(2)] = rng.choice(w.countries)
    city_names = list(w.cities)
    for _ in range(universities):
        w.universities[f"{fresh(2)} University"] = rng.choice(city_names)
    unis = list(w.universities)
    for _ in range(people):
        w.people[fresh(2)] = {"born": rng.randint(1900, 1990), "city": rng.choice(city_names), "university": rng.choice(unis)}  # fmt: skip
    names = list(w.people)
    for _ in range(works):
        kind = rng.choice(list(WORKS))
        creator = rng.choice(names)
        born = int(w.people[creator]["born"])  # type: ignore[arg-type]
        w.works[fresh(3)] = {
            "kind": kind,
            "year": rng.randint(born + 20, born + 60),
            "creator": creator,
        }
    # distractors: the same names in other contexts (a search for a bare name sees these too)
    for name in names[: people // 2]:
        other = rng.choice(city_names)
        w.distractors.append(
            (f"{other} festival", f"The {other} festival of {rng.randint(1950, 2020)} featured {name}.")
        )
    return w


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answer: str
    kind: str  # bridge | comparison
    hops: tuple[str, ...]  # the titles searched, in order (the demonstration's queries)


def questions(w: World, hops: int, kind: str, titles: list[str]) -> list[Question]:
    """One question per work title (comparison: per consecutive pair of titles)."""
    out = []
    if kind == "comparison":
        for a, b in zip(titles[0::2], titles[1::2], strict=False):
            ya, yb = int(w.works[a]["year"]), int(w.works[b]["year"])  # type: ignore[arg-type]
            if ya == yb:
                continue
            out.append(
                Question(
                    f"cmp:{a}|{b}",
                    f'Which was released first, "{a}" or "{b}"?',
                    a if ya < yb else b,
                    kind,
                    (a, b),
                )
            )
        return out
    for t in titles:
        work = w.works[t]
        role = WORKS[str(work["kind"])][1]
        person = str(work["creator"])
        p = w.people[person]
        city = str(p["city"])
        if hops == 2:
            q, ans, chain = f'Where was the {role} of "{t}" born?', city, (t, person)
            uni = str(p["university"])
            out.append(
                Question(
                    f"b2u:{t}", f'Which university did the {role} of "{t}" attend?', uni, kind, (t, person)
                )
            )
        elif hops == 3:
            q, ans, chain = (
                f'In which country was the {role} of "{t}" born?',
                w.cities[city],
                (t, person, city),
            )
        elif hops == 4:
            uni = str(p["university"])
            ucity = w.universities[uni]
            q = f'In which country is the university attended by the {role} of "{t}"?'
            ans, chain = w.cities[ucity], (t, person, uni, ucity)
        else:
            raise ValueError(f"hops must be 2, 3 or 4 for bridge questions, got {hops}")
        out.append(Question(f"b{hops}:{t}", q, ans, kind, chain))
    return out
