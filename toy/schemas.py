"""Schema families, value pools and the database builder of the toy set (toy/prepare_toy.py).

Every family has a parent table and a child table (child.fk -> parent.id), and every table gives
its columns a role the question templates use:
    label  a text column that names a row ("name", "title", "product")
    cat    a categorical text column ("city", "genre"); `nullable` ones get some NULLs
    num    an integer column ("age", "salary")
    date   an ISO date column ('2021-03-05'), or None
All databases of a family share table and column names and differ in their rows, so a tiny model
can learn the vocabulary of a family and still meet unseen rows (and literals) at eval time.
Categorical values are stored as codes, not as people say them (encode_categories): "Paris" is
'Paris4k', "pending" is 'pending7c'; the digit and the letter are drawn per database and value, so
only a look at the column (SELECT DISTINCT city FROM customers) tells which code a question's
"Paris" needs. Some databases put a column prefix before the word ('st_pending7c', 'ci_Paris4k'): a
lookup of the codes that *start* with the word finds nothing there, one of the codes that *contain*
it does. Every code has a twin in its column, stored on other rows: the same prefix and word, then
'_' and a capital letter ('Paris_N' beside 'Paris4k', 'ci_Paris_N' beside 'ci_Paris4k').
A lookup shows both, and the code is the one whose word is followed by a digit; an answer that
matches the word with a LIKE pattern instead of copying the code ('%Paris%', 'Paris%', 'Paris__')
matches the twin's rows too, so only reading the lookup answers the question.
Not run directly: `python -m toy.prepare_toy --out DIR` uses it.
"""
import datetime
import os
import random
import sqlite3
from collections import Counter
from pathlib import Path

CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Oslo", "Dublin",
          "Athens", "Warsaw", "Zurich", "Boston", "Denver", "Austin", "Toronto", "Sydney", "Osaka"]
COUNTRIES = ["France", "Spain", "Italy", "Japan", "Brazil", "Canada", "Kenya", "India", "Norway",
             "Mexico", "Chile", "Egypt", "Poland", "Greece"]
FIRST = ["Ann", "Bob", "Carl", "Dana", "Eva", "Finn", "Gina", "Hugo", "Ivy", "Jack", "Kara", "Liam",
         "Mia", "Noah", "Olga", "Paul", "Rosa", "Sam", "Tina", "Umar", "Vera", "Will", "Yara", "Zoe",
         "Alex", "Ben", "Cleo", "Dev", "Emma", "Omar", "Lena", "Ravi"]
LAST = ["Lee", "Smith", "Brown", "Garcia", "Kim", "Novak", "Silva", "Khan", "Rossi", "Meyer",
        "Chen", "Lopez", "Moore", "Young", "Hill", "Ward", "Price", "Reed", "Stone", "Cruz"]
PRODUCTS = ["lamp", "chair", "desk", "kettle", "mirror", "rug", "clock", "sofa", "vase", "shelf",
            "pillow", "blanket", "teapot", "stool", "candle"]
STATUSES = ["pending", "shipped", "delivered", "returned", "cancelled"]
SUBJECTS = ["math", "physics", "history", "biology", "music", "art", "chemistry", "english"]
GENRES = ["fantasy", "mystery", "romance", "history", "poetry", "science", "horror", "travel"]
ADJ = ["Silent", "Golden", "Hidden", "Broken", "Last", "Crimson", "Quiet", "Lost", "Wild", "Bright",
       "Dark", "Frozen", "Distant", "Secret", "Burning", "Empty"]
NOUN = ["River", "Garden", "Empire", "Mirror", "Winter", "Harbor", "Forest", "Letter", "Island",
        "Tower", "Voyage", "Shadow", "Bridge", "Storm", "Orchard", "Crown"]
SPECIALTIES = ["cardiology", "neurology", "pediatrics", "oncology", "surgery", "dermatology",
               "radiology", "psychiatry"]
DEPARTMENTS = ["Sales", "Research", "Marketing", "Finance", "Legal", "Support", "Design",
               "Logistics", "Security", "Training", "Quality", "Purchasing", "Operations", "Planning",
               "Audit", "Media"]
JOBS = ["engineer", "manager", "analyst", "clerk", "designer", "consultant", "technician"]

# value specs: ("person",) unique full names; ("titles",) unique "Adj Noun" titles;
# ("unique", POOL) distinct items of POOL; ("pick", POOL, k) k values of POOL chosen per database,
# rows draw among them (so databases differ in their literals); ("int", lo, hi, step); ("date",)
FAMILIES = {
    "shop": dict(
        rel="placed by",  # "<child plural> <rel> <parent label>": "orders placed by Ann Lee"
        parent=dict(table="customers", sing="customer", plural="customers",
                    cols={"name": ("person",), "city": ("pick", CITIES, 5), "age": ("int", 18, 80, 1),
                          "joined": ("date",)},
                    label="name", cat="city", num="age", date="joined", nullable="city",
                    words={"joined": "join date"}),
        child=dict(table="orders", sing="order", plural="orders", fk="customer_id",
                   cols={"product": ("pick", PRODUCTS, 8), "status": ("pick", STATUSES, 4),
                         "amount": ("int", 5, 500, 5), "order_date": ("date",)},
                   label="product", cat="status", num="amount", date="order_date",
                   words={"order_date": "order date"})),
    "school": dict(
        rel="taught by",
        parent=dict(table="teachers", sing="teacher", plural="teachers",
                    cols={"name": ("person",), "subject": ("pick", SUBJECTS, 5),
                          "salary": ("int", 30000, 90000, 1000), "hired": ("date",)},
                    label="name", cat="subject", num="salary", date="hired",
                    words={"hired": "hire date"}),
        child=dict(table="students", sing="student", plural="students", fk="teacher_id",
                   cols={"name": ("person",), "city": ("pick", CITIES, 5), "score": ("int", 40, 100, 1),
                         "enrolled": ("date",)},
                   label="name", cat="city", num="score", date="enrolled", nullable="city",
                   words={"enrolled": "enrollment date"})),
    "library": dict(
        rel="written by",
        parent=dict(table="authors", sing="author", plural="authors",
                    cols={"name": ("person",), "country": ("pick", COUNTRIES, 5),
                          "born": ("int", 1920, 1995, 1)},
                    label="name", cat="country", num="born", date=None, nullable="country",
                    words={"born": "birth year"}),
        child=dict(table="books", sing="book", plural="books", fk="author_id",
                   cols={"title": ("titles",), "genre": ("pick", GENRES, 5), "pages": ("int", 80, 900, 10),
                         "published": ("date",)},
                   label="title", cat="genre", num="pages", date="published",
                   words={"pages": "page count", "published": "publication date"})),
    "clinic": dict(
        rel="treated by",
        parent=dict(table="doctors", sing="doctor", plural="doctors",
                    cols={"name": ("person",), "specialty": ("pick", SPECIALTIES, 5),
                          "experience": ("int", 1, 40, 1)},
                    label="name", cat="specialty", num="experience", date=None,
                    words={"experience": "years of experience"}),
        child=dict(table="patients", sing="patient", plural="patients", fk="doctor_id",
                   cols={"name": ("person",), "city": ("pick", CITIES, 5), "age": ("int", 1, 95, 1),
                         "admitted": ("date",)},
                   label="name", cat="city", num="age", date="admitted", nullable="city",
                   words={"admitted": "admission date"})),
    "company": dict(
        rel="working in",
        parent=dict(table="departments", sing="department", plural="departments",
                    cols={"name": ("unique", DEPARTMENTS), "city": ("pick", CITIES, 4),
                          "budget": ("int", 10000, 500000, 5000), "founded": ("date",)},
                    label="name", cat="city", num="budget", date="founded",
                    words={"founded": "founding date"}),
        child=dict(table="employees", sing="employee", plural="employees", fk="department_id",
                   cols={"name": ("person",), "title": ("pick", JOBS, 5),
                         "salary": ("int", 25000, 150000, 1000), "hire_date": ("date",)},
                   label="name", cat="title", num="salary", date="hire_date", nullable="title",
                   words={"title": "job title", "hire_date": "hire date"})),
}


# -----------------------------------------------------------------------------
# databases


def _values(rng: random.Random, spec: tuple, n: int) -> list:
    kind = spec[0]
    if kind == "person":
        return [f"{a} {b}" for a, b in rng.sample([(a, b) for a in FIRST for b in LAST], n)]
    if kind == "titles":
        return [f"{a} {b}" for a, b in rng.sample([(a, b) for a in ADJ for b in NOUN], n)]
    if kind == "unique":
        return rng.sample(spec[1], n)
    if kind == "pick":  # a few values per database, so databases differ in their literals
        chosen = rng.sample(spec[1], spec[2])
        return [rng.choice(chosen) for _ in range(n)]
    if kind == "int":
        return [rng.randrange(spec[1], spec[2] + 1, spec[3]) for _ in range(n)]
    if kind == "date":
        start = datetime.date(2015, 1, 1).toordinal()
        return [datetime.date.fromordinal(start + rng.randrange(3650)).isoformat() for _ in range(n)]
    raise ValueError(spec)


def _sql_type(spec) -> str:
    return {"int": "INTEGER", "date": "DATE"}.get(spec[0], "TEXT")


def make_rows(rng: random.Random, fam: dict) -> dict[str, list[dict]]:
    """Rows of both tables. Some parents get no children (for NOT IN); the nullable column gets
    at least one NULL (for IS NULL); foreign keys are never NULL (NOT IN with NULLs is empty)."""
    # parents: 10-14 rows, so most category words keep two rows, one for the code and one for its twin
    n_p, n_c = rng.randint(10, 14), rng.randint(22, 34)
    rows = {}
    for side, n in (("parent", n_p), ("child", n_c)):
        t = fam[side]
        cols = {c: _values(rng, spec, n) for c, spec in t["cols"].items()}
        rs = [{"id": i + 1, **{c: v[i] for c, v in cols.items()}} for i in range(n)]
        if t.get("nullable"):
            for r in rs:
                if rng.random() < 0.15:
                    r[t["nullable"]] = None
            if all(r[t["nullable"]] is not None for r in rs):
                rng.choice(rs)[t["nullable"]] = None
        rows[side] = rs
    parents = list(range(1, n_p + 1))
    childless = set(rng.sample(parents, rng.randint(1, 2)))
    weights = [0 if p in childless else rng.random() + 0.2 for p in parents]  # skewed: a clear top parent
    for r in rows["child"]:
        r[fam["child"]["fk"]] = rng.choices(parents, weights)[0]
    return rows


# A digit and a letter right after the word ('Paris4k'): they follow the word's token directly, in
# the observation as in the SQL, which a small model learns to copy (find the word, take the next
# tokens). 'Paris-42' (a dash between) was never copied in 400 SFT steps (0% EX on held-out tool
# questions, against 13% for 'Paris4'). One digit alone (9 codes a word) repeats codes across
# databases, which a memoriser exploits; two digits ('Paris47') were copied in the wrong order
# ('Paris74') in most of the wrong tool answers after GRPO. A digit then a letter are two kinds of
# token: which comes first is never in doubt. 9 x 23 = 207 codes a word stay unique across databases.
CODE_DIGITS = "123456789"
CODE_LETTERS = "abcdefghjkmnpqrstuvwxyz"  # no i, l, o
CODE_SUFFIXES = [d + c for d in CODE_DIGITS for c in CODE_LETTERS]


def code_prefix(column: str) -> str:
    """The prefix a database with a prefixed naming convention stores before every code of the
    column ('status' -> 'st_': 'st_pending7c'). Fixed per column, so the warm start can learn to
    write it once the lookup has shown it; which databases use it is drawn per database."""
    return column[:2] + "_"


def twin_of(code: str, rng: random.Random) -> str:
    """The twin a code shares its column with: the code's prefix and word, then '_' and a capital
    letter, no digit ('Paris4k' -> 'Paris_N', 'ci_Paris4k' -> 'ci_Paris_S'). Same length and the
    same word at the same place: every LIKE pattern built from the word (and the column's prefix)
    alone that matches the code matches the twin too."""
    return code[:-2] + "_" + rng.choice(TWIN_LETTERS)


TWIN_LETTERS = "NSEW"


def _two_rows_per_word(rng: random.Random, rs: list[dict], col: str) -> None:
    """In place: a word stored on one row only is replaced there by a word on more rows, until every
    word present is on two rows or more (one row for its code, one for its twin)."""
    while True:
        count = Counter(r[col] for r in rs if r[col] is not None)
        single = sorted(w for w, n in count.items() if n == 1)
        if not single or len(count) == 1:
            return
        row = next(r for r in rs if r[col] == single[0])
        row[col] = rng.choice(sorted(w for w, n in count.items() if n >= 2) or sorted(set(count) - {single[0]}))


def encode_categories(rng: random.Random, fam: dict, rows: dict,
                      avoid: dict[str, set[int]] | None = None,
                      prefixed: tuple[str, ...] = ()) -> dict[str, dict[str, tuple[str, str]]]:
    """Replace every categorical value by its code or its code's twin, in place. The code is the word
    then a digit and a letter drawn here (CODE_SUFFIXES: 'Paris' -> 'Paris4k'), distinct within a
    column; the twin (twin_of: 'Paris_N') takes some of the word's rows, at least one, the code the
    others, at least one. The word is the piece the question shares with the code: the model copies
    it from the question, finds the row where it is followed by a digit in the lookup's observation
    and copies the digit and the letter from there (the same tokens in both places: after a line
    break and after the SQL quote the word has no leading space). `avoid` ({word: suffixes}: those
    earlier databases stored for the word)
    keeps a code from recurring across databases while a fresh one is left, so a policy that writes
    the code it saw most in training without looking (prepare_toy.memoriser_right) is never right
    held-out and seldom on train (toy set v2: 11% of the training tool questions at seed 0, where
    one-digit codes reused across databases gave it 31%, more than the warm start's two-lookup route
    earned, and GRPO dropped the tool).
    `prefixed` names the sides ("parent", "child") whose column stores its codes (and twins) behind
    code_prefix ('st_pending7c'): there the natural lookup (LIKE 'pending%') returns no rows and
    only a broader one (LIKE '%pending%') shows the code. Returns {table: {code: (word, twin)}}."""
    avoid = avoid or {}
    names = {}
    for side in ("parent", "child"):
        t, col = fam[side], fam[side]["cat"]
        _two_rows_per_word(rng, rows[side], col)
        present = sorted({r[col] for r in rows[side] if r[col] is not None})
        code, twin, used = {}, {}, set()
        for v in present:
            free = [x for x in CODE_SUFFIXES if x not in used]
            fresh = [x for x in free if x not in avoid.get(v, ())]
            suffix = rng.choice(fresh or free)
            used.add(suffix)
            code[v] = (code_prefix(col) if side in prefixed else "") + f"{v}{suffix}"
            twin[v] = twin_of(code[v], rng)
        for v in present:  # the twin's rows: between one and all but one of the word's rows
            mine = [r for r in rows[side] if r[col] == v]
            twins = rng.sample(range(len(mine)), rng.randint(1, len(mine) - 1)) if len(mine) > 1 else []
            for i, r in enumerate(mine):
                r[col] = twin[v] if i in twins else code[v]
        names[t["table"]] = {code[v]: (v, twin[v]) for v in present}
    return names


def ddl(fam: dict) -> list[str]:
    out = []
    for side in ("parent", "child"):
        t = fam[side]
        lines = ["id INTEGER PRIMARY KEY"] + [f"{c} {_sql_type(s)}" for c, s in t["cols"].items()]
        if side == "child":
            p = fam["parent"]["table"]
            lines += [f"{t['fk']} INTEGER NOT NULL", f"FOREIGN KEY ({t['fk']}) REFERENCES {p}(id)"]
        out.append(f"CREATE TABLE {t['table']} (\n  " + ",\n  ".join(lines) + "\n)")
    return out


def write_db(path: Path, fam: dict, rows: dict) -> None:
    """Build in a temp file, then rename: a finished file or none, and no stale pages. The temp
    name is this process's own (a build another process left half-done never shares it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(tmp)
    con.execute("PRAGMA journal_mode = OFF")  # no journal, no fsync: a half-written file is never
    con.execute("PRAGMA synchronous = OFF")   # renamed into place (the file's bytes are the same)
    for stmt in ddl(fam):
        con.execute(stmt)
    for side in ("parent", "child"):
        t, rs = fam[side], rows[side]
        cols = list(rs[0])
        con.executemany(f"INSERT INTO {t['table']} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                        [tuple(r[c] for c in cols) for r in rs])
    con.commit()
    con.close()
    os.replace(tmp, path)
