from django.db import models


class Order(models.Model):
    customer = models.TextField()
    total = models.DecimalField(max_digits=10, decimal_places=2)
    state = models.TextField(default="placed")
