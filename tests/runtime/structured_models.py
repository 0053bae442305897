"""Twenty Pydantic models of increasing depth, the shapes applications ask for with
`client.chat.completions.parse(response_format=Model)`: flat objects, enums, optional fields,
arrays, nested objects, `anyOf` unions, recursion-free trees of several levels. Strings and
arrays and integers are bounded, as a real application's models are, so that an answer fits
`max_tokens` (a JSON integer has no length limit, and a small model at temperature 1 can write
digits until it runs out of tokens)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

Name = Field(min_length=1, max_length=24)
Small = Annotated[int, Field(ge=0, le=1000)]


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: str = Name


class Person(BaseModel):
    name: str = Name
    age: int = Field(ge=0, le=150)


class Answer(BaseModel):
    answer: Literal["yes", "no"]


class Flag(BaseModel):
    enabled: bool
    color: Color


class Measurement(BaseModel):
    value: float
    unit: Literal["cm", "kg", "s"]


class Tagged(BaseModel):
    title: str = Name
    tags: list[str] = Field(max_length=3)


class Contact(BaseModel):
    name: str = Name
    email: str | None = Field(default=None, max_length=40)
    phone: str | None = Field(default=None, pattern=r"^[0-9]{3}-[0-9]{4}$")


class Address(BaseModel):
    street: str = Name
    city: str = Name
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Employee(BaseModel):
    person: Person
    address: Address


class Scores(BaseModel):
    scores: list[Small] = Field(min_length=1, max_length=4)
    best: Small


class Point(BaseModel):
    x: float
    y: float


class Polygon(BaseModel):
    name: str = Name
    points: list[Point] = Field(min_length=3, max_length=4)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    pet: Cat | Dog  # anyOf of two objects


class Item(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    quantity: int = Field(ge=1, le=99)
    price: float


class Order(BaseModel):
    order_id: int = Field(ge=1, le=99999)
    items: list[Item] = Field(min_length=1, max_length=3)
    status: Literal["open", "paid", "shipped"]


class Leaf(BaseModel):
    label: str = Name


class Branch(BaseModel):
    label: str = Name
    leaves: list[Leaf] = Field(max_length=2)


class Tree(BaseModel):
    root: str = Name
    branches: list[Branch] = Field(max_length=2)


class Event(BaseModel):
    title: str = Name
    day: Literal["mon", "tue", "wed", "thu", "fri"]
    attendees: list[Person] = Field(max_length=2)
    location: Address | None = None


class Team(BaseModel):
    name: str = Name
    lead: Employee
    members: list[Person] = Field(max_length=2)
    color: Color


class Department(BaseModel):
    name: str = Name
    teams: list[Team] = Field(min_length=1, max_length=1)
    budget: Small | float | None = None


class Company(BaseModel):
    name: str = Name
    department: Department
    pets: list[Pet] = Field(max_length=1)
    orders: list[Order] = Field(max_length=1)


MODELS: list[type[BaseModel]] = [
    City,
    Person,
    Answer,
    Flag,
    Measurement,
    Tagged,
    Contact,
    Address,
    Employee,
    Scores,
    Polygon,
    Pet,
    Item,
    Order,
    Tree,
    Event,
    Team,
    Department,
    Company,
    Branch,
]
