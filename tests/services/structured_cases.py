"""Ten small prompts and Pydantic schemas for the structured-output tests: nested objects, enums,
arrays, required and optional fields, bounded so a 135M model finishes them in few tokens."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Name = Field(min_length=1, max_length=12)


class City(BaseModel):
    name: str = Name
    country: str = Name


class Person(BaseModel):
    name: str = Name
    age: int
    city: City


class Color(BaseModel):
    color: Literal["red", "green", "blue"]


class Planets(BaseModel):
    planets: list[str] = Field(min_length=2, max_length=3)


class Weather(BaseModel):
    city: str = Name
    celsius: int
    sky: Literal["sunny", "cloudy", "rainy"]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = Name
    legs: int


class Book(BaseModel):
    title: str = Field(min_length=1, max_length=20)
    year: int


class Answer(BaseModel):
    answer: bool


class Point(BaseModel):
    x: int
    y: int


class Route(BaseModel):
    start: Point
    end: Point


class Fruit(BaseModel):
    fruit: str = Name
    colors: list[Literal["red", "yellow", "green"]] = Field(min_length=1, max_length=2)


class Order(BaseModel):
    item: str = Name
    quantity: int
    note: str | None = Field(max_length=12)


CASES: list[tuple[str, type[BaseModel]]] = [
    ("Describe a person who lives in Paris.", Person),
    ("What color is the sky?", Color),
    ("Name a few planets.", Planets),
    ("What is the weather in London?", Weather),
    ("Describe a pet.", Pet),
    ("Name a famous book.", Book),
    ("Is water wet?", Answer),
    ("Give a route between two points.", Route),
    ("Name a fruit and its colors.", Fruit),
    ("Order some apples.", Order),
]
