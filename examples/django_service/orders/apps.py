from django.apps import AppConfig


class OrdersConfig(AppConfig):
    name = "examples.django_service.orders"
    label = "orders"
