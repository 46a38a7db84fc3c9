from django.urls import path

from examples.django_service.orders import views

urlpatterns = [
    path("orders", views.place_order),
    path("orders/<int:order_id>/pay", views.pay),
]
